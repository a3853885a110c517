-- stock: what one shard holds for the others, read at one instant.
-- KEYS[1] meta, KEYS[2] packets, KEYS[3] transfers (journal)
-- Returns {transfer_seq, unclaimed packets in the list, journal entries, state}.
-- transfer_seq moves with every transfer_out, transfer_in and transfer_done on the
-- shard, and with nothing else: a reader that sees the same sequence on every shard
-- before and after reading their stocks read them with no packet moving between
-- shards, while grabs could only have lowered them.
local m = redis.call('HMGET', KEYS[1], 'transfer_seq', 'state')
return {tonumber(m[1]) or 0, redis.call('LLEN', KEYS[2]), redis.call('HLEN', KEYS[3]), m[2] or ''}
