-- seed_stage: append one chunk of packets to the staging list, exactly once.
-- KEYS[1] meta, KEYS[2] staging
-- ARGV[1] offset: how many packets precede this chunk; ARGV[2] fingerprint of the
-- whole split; ARGV[3..] "<packetId>:<amount>@<countBefore>:<amountBefore>" (see grab.lua)
-- Returns -1 when the activity is already committed, else the staging length after
-- the call. A chunk is appended only when the staging list ends exactly at its
-- offset, so a retried or concurrent seeder can never stage a packet twice. Staging
-- left by a different split (another fingerprint) is discarded first, so chunks of
-- two splits never mix.
if redis.call('HEXISTS', KEYS[1], 'state') == 1 then
  return -1
end
if redis.call('HGET', KEYS[1], 'staging_fp') ~= ARGV[2] then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'staging_fp', ARGV[2])
end
local n = redis.call('LLEN', KEYS[2])
if n ~= tonumber(ARGV[1]) then
  return n
end
local batch = 1000
for i = 3, #ARGV, batch do
  local last = math.min(i + batch - 1, #ARGV)
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, last))
end
return n + #ARGV - 2
