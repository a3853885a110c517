-- configure: set the schedule and pause flag of a committed activity, and open it.
-- KEYS[1] meta
-- ARGV[1] start ms (0 = none), ARGV[2] end ms (0 = none), ARGV[3] paused (0|1),
-- ARGV[4] open (1 moves a ready activity to open)
-- Returns the state after the call, or "missing" when the activity is not in Redis
-- (nothing is written then, so a lost activity is never recreated by accident).
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return 'missing'
end
if state == 'closed' then
  return state
end
if ARGV[4] == '1' then
  state = 'open'
end
redis.call('HSET', KEYS[1], 'start_ms', ARGV[1], 'end_ms', ARGV[2], 'paused', ARGV[3],
  'state', state)
return state
