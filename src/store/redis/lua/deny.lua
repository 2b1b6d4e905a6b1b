#!lua
-- deny.lua: an approver denies one pending call (AWAITING_APPROVAL, or
-- APPROVED and not yet claimed), named by its attempt: DENIED, its slot
-- and cost come back, and its key replays the denial. The same denial
-- again answers the same (domain/ledger.rs: Ledger::deny).
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open (unused)  KEYS[4]  <prefix>:{P}:dup (unused)
-- KEYS[5]  <prefix>:{P}:held (unused)
-- KEYS[6]  <prefix>:uncertain:{T}:t:<tenant> (unused)
-- KEYS[7]  <prefix>:uncertain:{T} (unused)
-- KEYS[8]  <prefix>:{P}:pending    KEYS[9]  <prefix>:{P}:awaiting
-- KEYS[10] <prefix>:approvals:{T}:t:<tenant>  (the approvals index's shard)
-- ARGV[1]  now (ms; "" = Redis's clock)  ARGV[2]  idempotency key
-- ARGV[3]  attempt id (16 bytes)   ARGV[4]  the denial's reason
-- ARGV[5]  the caller's tenant     ARGV[6]  the caller's agent key id (""
--          = not limited): lib.lua, visible
-- ARGV[7]  the caller's key id ("" in dev mode): who denied it
--
-- Returns {"OK", attempt, usage}, or {"ERR", "PERMIT_NOT_FOUND"} |
-- {"ERR", "ATTEMPT_NOT_FOUND"} | {"ERR", "ATTEMPT_MISMATCH"} |
-- {"ERR", "ATTEMPT_STATE_CONFLICT", state} (not pending, nor denied for
-- this reason) | {"ERR", "STORE_UNAVAILABLE", why} (a permit field or a
-- record not as atmost writes it, a pending set that disagrees with the
-- attempt, counters that cannot hold it, a key of another type; nothing
-- is written then, but the lapses due, written first: lib.lua, lapse).
-- Example: ARGV={"","order-42",<uuid>,"too large","acme","","alice"}
--   -> {"OK", {<attempt>}, {"payments.charge","0",1,"3",1,"1000"}}

local now, key, reason = clock(ARGV[1]), ARGV[2], ARGV[4]
local p, refused = permit_for(KEYS, now, ARGV[5], ARGV[6], 'budget',
  'committed', 'reserved', 'appr')
if refused then
  return refused
end
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
-- Its tool's cap and slots, for its usage. The attempt exists, so its
-- tool is in scope (t:<tool>) and was authorized (n:<tool>).
local q = read_permit(KEYS[1], 't:' .. a.tool, 'n:' .. a.tool)
if q.unreadable or not (q['t:' .. a.tool] and q['n:' .. a.tool]) then
  return UNREADABLE_PERMIT
end
p['t:' .. a.tool], p['n:' .. a.tool] = q['t:' .. a.tool], q['n:' .. a.tool]
if is_pending(a.state) then
  -- Not past its deadline: the lapses were written above.
  local calls, why = pending_counts(KEYS, {{key = key, a = a}})
  if not calls then
    return why
  end
  if not redis.call('ZSCORE', KEYS[8], at15(a.lease) .. ':' .. key) then
    return PENDING_SET_DISAGREES
  end
  pending_write(KEYS, p, calls, now, {reason = reason, by = ARGV[7], at = now})
elseif not (a.state == DENIED and a.ap.reason == reason) then
  return {'ERR', 'ATTEMPT_STATE_CONFLICT', (observed_state(a, now))}
end
return {'OK', attempt_reply(a, key, now),
  usage(a.tool, p['n:' .. a.tool], p['t:' .. a.tool], p.budget, p.committed, p.reserved)}
