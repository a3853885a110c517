-- ledger_credit: decide, once and for good, whether settlement may credit each of a
-- batch of stream entries, and record the decision in the operator's ledger.
-- KEYS[1] the activity's ledger hash, rpl:{<uid>}:ledger (an operator-only key: the
-- activity's Redis user may not touch it)
-- ARGV[1] the activity's total amount, ARGV[2] its count of packets, then four
-- arguments per entry: kind (grant|refund), packet id, user id, amount.
-- The entries have passed every other check (their claim, the split) before.
-- Ledger fields: "p:<packetId>" -> the user it was credited to; "credited" the sum
-- of the grants credited, "grants" their number, "refund" the refund credited and
-- "refund_user" to whom.
-- Per entry, in order, one verdict:
--   "ok"        recorded now: deliver it;
--   "again"     recorded before for the same packet and user (a redelivery, a
--               replayed dead letter): deliver it, nothing changes;
--   "duplicate_packet:<user>"  the packet was credited to <user> already;
--   "over_budget" the credits plus the refund would exceed the total;
--   "over_count"  more grants than packets.
-- Only "ok" writes, so a refused entry leaves the ledger as it was and the sums never
-- exceed the total, whatever order the entries come in.
local total = tonumber(ARGV[1])
local count = tonumber(ARGV[2])
local credited = tonumber(redis.call('HGET', KEYS[1], 'credited') or '0')
local grants = tonumber(redis.call('HGET', KEYS[1], 'grants') or '0')
local refund = tonumber(redis.call('HGET', KEYS[1], 'refund') or '0')
local out = {}
for i = 3, #ARGV, 4 do
  local kind, packet, user, amount = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  local verdict
  if kind == 'refund' then
    local to = redis.call('HGET', KEYS[1], 'refund_user')
    if to then
      if to == user and refund == amount then
        verdict = 'again'
      else
        verdict = 'duplicate_packet:' .. to
      end
    elseif credited + amount > total then
      verdict = 'over_budget'
    else
      refund = amount
      redis.call('HSET', KEYS[1], 'refund', amount, 'refund_user', user)
      verdict = 'ok'
    end
  else
    local field = 'p:' .. packet
    local to = redis.call('HGET', KEYS[1], field)
    if to then
      if to == user then
        verdict = 'again'
      else
        verdict = 'duplicate_packet:' .. to
      end
    elseif credited + refund + amount > total then
      verdict = 'over_budget'
    elseif grants + 1 > count then
      verdict = 'over_count'
    else
      credited = credited + amount
      grants = grants + 1
      redis.call('HSET', KEYS[1], field, user, 'credited', credited, 'grants', grants)
      verdict = 'ok'
    end
  end
  out[#out + 1] = verdict
end
return out
