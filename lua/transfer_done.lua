-- transfer_done: the source forgets a transfer the destination has applied.
-- KEYS[1] meta, KEYS[2] transfers (journal) of the source shard
-- ARGV[1] transfer id
-- Returns 1 when the entry was removed now, 0 when it was already gone. Call it only
-- after transfer_in answered applied: the destination's record of the id is what
-- keeps a retried transfer_in from applying the packets twice, and it is never
-- removed while the activity lives.
if redis.call('HDEL', KEYS[2], ARGV[1]) == 0 then
  return 0
end
redis.call('HINCRBY', KEYS[1], 'transfer_seq', 1)
return 1
