-- configure: set the schedule and pause flag of a committed activity, keep its payee
-- current, and open it.
-- KEYS[1] meta
-- ARGV[1] start ms (0 = none), ARGV[2] end ms (0 = none), ARGV[3] paused (0|1),
-- ARGV[4] open (1 moves a ready activity to open), ARGV[5] sponsor and ARGV[6]
-- currency (optional; when given, the refund at close goes to this sponsor and
-- later grants record this currency)
-- Returns the state after the call, "missing" when the activity is not in Redis
-- (nothing is written then, so a lost activity is never recreated by accident), or
-- "fenced" when the activity is fenced after a rollback (nothing is written: a
-- fenced activity is never reopened by configuring it).
local m = redis.call('HMGET', KEYS[1], 'state', 'fenced')
local state = m[1]
if not state then
  return 'missing'
end
if m[2] then
  return 'fenced'
end
if state == 'closed' then
  return state
end
if ARGV[4] == '1' then
  state = 'open'
end
-- The gate cached what the fields said; "-" sends the next grab to the fields, and
-- it writes the gate again from them (see grab.lua).
redis.call('HSET', KEYS[1], 'start_ms', ARGV[1], 'end_ms', ARGV[2], 'paused', ARGV[3],
  'state', state, 'gate', '-')
if ARGV[5] then
  redis.call('HSET', KEYS[1], 'sponsor', ARGV[5], 'currency', ARGV[6] or '')
end
return state
