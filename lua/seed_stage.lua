-- seed_stage: append one chunk of packets to the staging list, exactly once.
-- KEYS[1] meta, KEYS[2] staging
-- ARGV[1] offset: how many packets precede this chunk; ARGV[2..] "<packetId>:<amount>"
-- Returns -1 when the activity is already committed, else the staging length after
-- the call. A chunk is appended only when the staging list ends exactly at its
-- offset, so a retried or concurrent seeder can never stage a packet twice.
if redis.call('HEXISTS', KEYS[1], 'state') == 1 then
  return -1
end
local n = redis.call('LLEN', KEYS[2])
if n ~= tonumber(ARGV[1]) then
  return n
end
local batch = 1000
for i = 2, #ARGV, batch do
  local last = math.min(i + batch - 1, #ARGV)
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, last))
end
return n + #ARGV - 1
