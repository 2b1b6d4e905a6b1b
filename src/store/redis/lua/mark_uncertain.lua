#!lua
-- mark_uncertain.lua: the call was sent and its response lost. RESERVED
-- (lease open or passed) -> UNCERTAIN; UNCERTAIN stays as it is. The slot
-- and the money stay held (domain/ledger.rs: Ledger::mark_uncertain).
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open       KEYS[4]  <prefix>:{P}:dup (unused)
-- KEYS[5]  <prefix>:{P}:held
-- KEYS[6]  <prefix>:uncertain:{T}:t:<tenant>  KEYS[7]  <prefix>:uncertain:{T}
--          (the uncertain index's shards of the permit: lib.lua)
-- KEYS[8]  <prefix>:{P}:pending    KEYS[9]  <prefix>:{P}:awaiting
-- KEYS[10] <prefix>:approvals:{T}:t:<tenant>  (the approvals index's shard:
--          the lapses due are written first, lib.lua: lapse)
-- ARGV[1]  now (ms; "" = Redis's clock)  ARGV[2]  idempotency key
-- ARGV[3]  attempt id (16 bytes)   ARGV[4]  reason (non-empty)
-- ARGV[5]  the caller's tenant     ARGV[6]  the caller's agent key id (""
--          = not limited): lib.lua, visible
--
-- Returns {"OK", attempt}, or {"ERR", "PERMIT_NOT_FOUND"} |
-- {"ERR", "ATTEMPT_NOT_FOUND"} |
-- {"ERR", "ATTEMPT_MISMATCH"} | {"ERR", "ATTEMPT_HOLDER_MISMATCH"} (an
-- agent key that did not reserve it: lib.lua, held_by) |
-- {"ERR", "ATTEMPT_STATE_CONFLICT", state} |
-- {"ERR", "STORE_UNAVAILABLE", why} (a permit field or the attempt record
-- not as atmost writes it, the attempt's member missing from the open or
-- held set, a pending member that names no pending call, a key of another
-- type; nothing is written then, but the lapses due, written first:
-- lib.lua, lapse).
-- Example: ARGV={"1767225600000","order-42",<uuid>,"client deadline exceeded"}

local now, key = clock(ARGV[1]), ARGV[2]
local p, refused = permit_for(KEYS, now, ARGV[5], ARGV[6], 'upol', 'appr')
if refused then
  return refused
end
local hold = p.upol == true
-- The lapses due first (lib.lua: lapse).
local lapsed, unreadable = lapse(KEYS, p, now)
if not lapsed then
  return unreadable
end
local a = load_attempt(KEYS[2], key)
if a == false then
  return UNREADABLE_ATTEMPT
end
if not a then
  return {'ERR', 'ATTEMPT_NOT_FOUND'}
end
if a.id ~= ARGV[3] then
  return {'ERR', 'ATTEMPT_MISMATCH'}
end
if not held_by(a.by, ARGV[6]) then
  return {'ERR', 'ATTEMPT_HOLDER_MISMATCH'}
end
if a.state == RESERVED then
  -- Its members move: they must be where it is.
  if not open_has(KEYS, hold, a, key) then
    return OPEN_SET_DISAGREES
  end
  if not index_ready(KEYS) then
    return INDEX_OF_ANOTHER_TYPE
  end
  -- Uncertain from now on, or since its lease ended if that was earlier:
  -- it never moves later in the listing order.
  open_del(KEYS, hold, a, key, a.lease)
  a.state, a.ureason, a.token, a.usince = UNCERTAIN, ARGV[4], '', math.min(a.lease, now)
  open_add(KEYS, hold, a, key, a.usince)
  save_attempt(KEYS[2], key, a)
elseif a.state ~= UNCERTAIN then
  return {'ERR', 'ATTEMPT_STATE_CONFLICT', (observed_state(a, now))}
end
return {'OK', attempt_reply(a, key, now)}
