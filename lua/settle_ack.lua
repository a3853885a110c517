-- settle_ack: acknowledge a delivered stream entry and count it as settled, once.
-- KEYS[1] meta, KEYS[2] stream
-- ARGV[1] consumer group, ARGV[2] entry id, ARGV[3] kind (grant|refund|create), ARGV[4] amount
-- A budget packet's creation record (create) is acknowledged once booked, and counts
-- nothing: it is not a credit.
-- Returns 1 when this call settled the entry, 0 when it had been acknowledged before
-- (by a worker that took it over, say), so nothing is ever counted twice. Once the
-- activity's meta hash is purged (its unsettled streams kept for retention), the
-- entry is acknowledged but nothing is counted: the counters are not brought back as
-- a key without a TTL.
local n = redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
if n == 1 and redis.call('HEXISTS', KEYS[1], 'state') == 1 then
  if ARGV[3] == 'refund' then
    redis.call('HINCRBY', KEYS[1], 'refund_settled', ARGV[4])
  elseif ARGV[3] ~= 'create' then
    redis.call('HINCRBY', KEYS[1], 'settled_count', 1)
    redis.call('HINCRBY', KEYS[1], 'settled_amount', ARGV[4])
  end
end
return n
