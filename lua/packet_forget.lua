-- packet_forget: delete an expired runtime packet's hash, once its refund settled.
-- KEYS[1] the packet's hash
-- Returns 1 when this call deleted it, 0 when there is no such packet, and an error,
-- deleting nothing, for a packet that has not expired: its money is still live, and
-- its hash is what says so.
local x = redis.call('HMGET', KEYS[1], 'x', 'cnt')
if x[1] then
  redis.call('UNLINK', KEYS[1])
  return 1
end
if x[2] then
  return redis.error_reply('ERR packet ' .. KEYS[1] .. ' has not expired')
end
return 0
