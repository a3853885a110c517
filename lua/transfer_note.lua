-- transfer_note: a shard records how far a sibling that gives it packets has got, so
-- that the mark outlives the sibling's own data.
-- KEYS[1] meta, KEYS[2] applied transfers (xin) of the destination shard
-- ARGV[1] the source shard's index (0 to 63), ARGV[2] the source's transfer_seq
-- after its transfer_out, ARGV[3] the epoch it was read in
-- Returns the note held after the call, "<epoch>:<transfer_seq>", or '' when the
-- destination's meta has no state (missing: nothing is written then).
--
-- The note is the field "^<source>" of the applied hash (transfer ids never start
-- with '^'), raised only: a later epoch replaces it, a higher sequence in the same
-- epoch raises it, anything else leaves it. store.Activity writes it on the
-- destination before transfer_in may apply the packets there, and every grab pod
-- reads the notes of all shards (HMGET) before it grants on a shard, at most
-- store.DefaultMarkRefresh before: a source that comes back from before its
-- transfer_out (a failover to a replica without it, a restored backup) is below the
-- note and is fenced by the first grab or transfer that carries it, whichever pod
-- sends it, while the note lives on a shard that did not lose it.
--
-- Bounded work: two hash reads and at most one write, on arguments checked before
-- anything is read.
local src, seq, epoch = ARGV[1], ARGV[2], ARGV[3]
if not (src and seq and epoch) or #src > 2 or not string.match(src, '^%d+$')
    or #seq > 18 or not string.match(seq, '^%d+$') or #epoch > 18 or not string.match(epoch, '^%d+$') then
  return redis.error_reply('ERR transfer_note wants a shard index and two non-negative integers')
end
if not redis.call('HGET', KEYS[1], 'state') then
  return ''
end
local field = '^' .. src
local held = redis.call('HGET', KEYS[2], field)
if held then
  local e, s = string.match(held, '^(%d+):(%d+)$')
  e, s = tonumber(e) or 0, tonumber(s) or 0
  local ne, ns = tonumber(epoch), tonumber(seq)
  if ne < e or (ne == e and ns <= s) then
    return held
  end
end
local note = epoch .. ':' .. seq
redis.call('HSET', KEYS[2], field, note)
return note
