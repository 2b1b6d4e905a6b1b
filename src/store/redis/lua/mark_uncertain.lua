-- mark_uncertain.lua: the call was sent and its response lost. RESERVED
-- (lease open or passed) -> UNCERTAIN; UNCERTAIN stays as it is. The slot
-- and the money stay held (domain/ledger.rs: Ledger::mark_uncertain).
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- ARGV[1]  now (ms)                ARGV[2]  idempotency key
-- ARGV[3]  attempt id (16 bytes)   ARGV[4]  reason (non-empty)
--
-- Returns {"OK", attempt}, or {"ERR", "PERMIT_NOT_FOUND"} |
-- {"ERR", "ATTEMPT_NOT_FOUND"} |
-- {"ERR", "ATTEMPT_MISMATCH"} | {"ERR", "ATTEMPT_STATE_CONFLICT", state}.
-- Example: ARGV={"1767225600000","order-42",<uuid>,"client deadline exceeded"}

local now, key = tonumber(ARGV[1]), ARGV[2]
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'ERR', 'PERMIT_NOT_FOUND'}
end
local a = load_attempt(KEYS[2], key)
if not a then
  return {'ERR', 'ATTEMPT_NOT_FOUND'}
end
if a.id ~= ARGV[3] then
  return {'ERR', 'ATTEMPT_MISMATCH'}
end
if a.state == RESERVED then
  a.state, a.ureason, a.token = UNCERTAIN, ARGV[4], ''
  save_attempt(KEYS[2], key, a)
elseif a.state ~= UNCERTAIN then
  return {'ERR', 'ATTEMPT_STATE_CONFLICT', a.state}
end
return {'OK', attempt_reply(a, key, now)}
