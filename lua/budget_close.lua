-- budget_close: stop creation on a budget shard for good (the budget is being
-- deleted). packet_expire then expires every live packet at once, whatever its time.
-- KEYS[1] the shard's meta
-- Returns 1 when the shard is closed (by this call or before), 0 when the shard was
-- never configured (nothing is written then).
if not redis.call('HGET', KEYS[1], 'state') then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'closed')
return 1
