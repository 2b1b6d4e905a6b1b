#!lua
-- mark_uncertain.lua: the call was sent and its response lost. RESERVED
-- (lease open or passed) -> UNCERTAIN; UNCERTAIN stays as it is. The slot
-- and the money stay held (domain/ledger.rs: Ledger::mark_uncertain).
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open       KEYS[4]  <prefix>:{P}:dup (unused)
-- KEYS[5]  <prefix>:{P}:held
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
-- {"ERR", "STORE_UNAVAILABLE", why}.
-- Example: ARGV={"1767225600000","order-42",<uuid>,"client deadline exceeded"}

local now, key = clock(ARGV[1]), ARGV[2]
local p = redis.call('HMGET', KEYS[1], 'exp', 'upol', 'fa', 'open', 'ten', 'agents')
if not p[1] or forgotten(p[3], p[4], now) then
  return permit_not_found(p[1], KEYS[2])
end
if not visible(p[5], p[6], ARGV[5], ARGV[6]) then
  return NOT_VISIBLE
end
local hold = holds(p[2])
if hold == nil then
  return UNREADABLE_PERMIT
end
local a = load_attempt(KEYS[2], key)
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
  -- Uncertain from now on, or since its lease ended if that was earlier:
  -- it never moves later in the listing order.
  open_del(KEYS, hold, a, key, a.lease)
  a.state, a.ureason, a.token, a.usince = UNCERTAIN, ARGV[4], '', math.min(a.lease, now)
  open_add(KEYS, hold, a, key, a.usince)
  save_attempt(KEYS[2], key, a)
elseif a.state ~= UNCERTAIN then
  return {'ERR', 'ATTEMPT_STATE_CONFLICT', a.state}
end
return {'OK', attempt_reply(a, key, now)}
