#!lua flags=no-writes
-- get_attempt.lua: one idempotency key's attempt, as every reader sees it
-- at `now` (a RESERVED attempt past its lease reads UNCERTAIN,
-- "lease_expired"): domain/ledger.rs, Ledger::get_attempt. Reads only.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- ARGV[1]  now (ms; "" = Redis's clock)  ARGV[2]  idempotency key
-- ARGV[3]  the caller's tenant     ARGV[4]  the caller's agent key id (""
--          = not limited): lib.lua, visible
--
-- Returns {"OK", attempt}, or {"ERR", "PERMIT_NOT_FOUND"} (none, forgotten,
-- or not visible to the caller) | {"ERR", "ATTEMPT_NOT_FOUND"} |
-- {"ERR", "STORE_UNAVAILABLE", why} (a permit field or the attempt record
-- not as atmost writes it, or the permit gone while its attempts remain).
-- Example: ARGV={"","order-42","acme",""} -> {"OK", {<id>,"wallet.charge",...}}

local now, key = clock(ARGV[1]), ARGV[2]
local _, refused = permit_for(KEYS, now, ARGV[3], ARGV[4])
if refused then
  return refused
end
local a = load_attempt(KEYS[2], key)
if a == false then
  return UNREADABLE_ATTEMPT
end
if not a then
  return {'ERR', 'ATTEMPT_NOT_FOUND'}
end
return {'OK', attempt_reply(a, key, now)}
