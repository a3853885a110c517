-- ledger_allowance: read or record that the activity's allowance (what the
-- operator seeded, the most its settlement may credit) was announced to the balance
-- system. The ledger's field keeps its name, "budget".
-- KEYS[1] the activity's ledger hash, rpl:{<uid>}:ledger (operator-only)
-- ARGV[1] "get" or "set", ARGV[2] (set) the announced "<amount>:<count>"
-- Returns the announced "<amount>:<count>", or false when none was.
if ARGV[1] == 'set' then
  redis.call('HSETNX', KEYS[1], 'budget', ARGV[2])
end
return redis.call('HGET', KEYS[1], 'budget')
