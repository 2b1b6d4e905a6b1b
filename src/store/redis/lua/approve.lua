#!lua
-- approve.lua: an approver approves one call awaiting approval, named by
-- its attempt (domain/ledger.rs: Ledger::approve). An approval by a key
-- that has not approved it yet and did not request it; the last one the
-- rule needs makes it APPROVED, for its requester to claim (authorize.lua)
-- within a lease from now, or by the request's own deadline if that is
-- later, and never past the permit's expiry (or that deadline).
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open (unused)  KEYS[4]  <prefix>:{P}:dup (unused)
-- KEYS[5]  <prefix>:{P}:held (unused)
-- KEYS[6]  <prefix>:uncertain:{T}:t:<tenant> (unused)
-- KEYS[7]  <prefix>:uncertain:{T} (unused)
-- KEYS[8]  <prefix>:{P}:pending    KEYS[9]  <prefix>:{P}:awaiting
-- KEYS[10] <prefix>:approvals:{T}:t:<tenant>  (the approvals index's shard)
-- ARGV[1]  now (ms; "" = Redis's clock)  ARGV[2]  idempotency key
-- ARGV[3]  attempt id (16 bytes)
-- ARGV[4]  the caller's tenant     ARGV[5]  the caller's agent key id (""
--          = not limited): lib.lua, visible
-- ARGV[6]  the caller's key id ("" in dev mode): the approver
--
-- Returns {"OK", attempt} (approved by one more key, APPROVED once the
-- rule has its approvers; a repeat by a key that approved it already
-- answers the attempt as it is, unless it was denied), or
-- {"ERR", "PERMIT_NOT_FOUND"} | {"ERR", "ATTEMPT_NOT_FOUND"} |
-- {"ERR", "ATTEMPT_MISMATCH"} | {"ERR", "APPROVER_IS_REQUESTER"} (the key
-- that requested it) | {"ERR", "ATTEMPT_STATE_CONFLICT", state} (a call
-- that needed no approval, or is no longer awaiting it) |
-- {"ERR", "STORE_UNAVAILABLE", why} (a permit field or a record not as
-- atmost writes it, a pending or awaiting set that disagrees with the
-- attempt, a key of another type; nothing is written then, but the lapses
-- due, written first: lib.lua, lapse).
-- Example: ARGV={"","order-42",<uuid>,"acme","","alice"} -> {"OK", {<attempt>}}

local now, key, me = clock(ARGV[1]), ARGV[2], ARGV[6]
local p, refused = permit_for(KEYS, now, ARGV[4], ARGV[5], 'lease', 'appr')
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
local state = observed_state(a, now)
local ap = a.ap
if not ap then
  return {'ERR', 'ATTEMPT_STATE_CONFLICT', state}
end
-- In dev mode (no keys) every caller is "": nobody could approve.
if me ~= '' and me == a.by then
  return {'ERR', 'APPROVER_IS_REQUESTER'}
end
local again = false
for _, k in ipairs(ap.approved) do
  if k == me then
    again = true
  end
end
if again and state ~= DENIED then
  -- Recorded already (and whatever followed): answered as it is.
  return {'OK', attempt_reply(a, key, now)}
end
if state ~= AWAITING then
  return {'ERR', 'ATTEMPT_STATE_CONFLICT', state}
end
ap.approved[#ap.approved + 1] = me
if #ap.approved >= ap.needed then
  -- Approved: claimable until claim_by, in the pending set at that
  -- deadline, no longer awaiting.
  local deadline = a.lease
  local member = at15(deadline) .. ':' .. key
  local waiting = at15(a.created) .. ':' .. key
  if not (redis.call('ZSCORE', KEYS[8], member)
      and redis.call('ZSCORE', KEYS[9], waiting)) then
    return PENDING_SET_DISAGREES
  end
  if not approvals_ready(KEYS) then
    return APPROVALS_OF_ANOTHER_TYPE
  end
  local claim_by = math.min(math.max(now + p.lease, deadline), math.max(p.exp, deadline))
  ap.by, ap.at, ap.expires = me, now, claim_by
  a.state, a.lease = APPROVED, claim_by
  if claim_by ~= deadline then
    -- Added before the old member goes, so the set (and its expiry)
    -- stays.
    redis.call('ZADD', KEYS[8], 0, at15(claim_by) .. ':' .. key)
    redis.call('ZREM', KEYS[8], member)
  end
  redis.call('ZREM', KEYS[9], waiting)
  redis.call('ZREM', KEYS[10], index_member(KEYS, a.created, key))
end
save_attempt(KEYS[2], key, a)
return {'OK', attempt_reply(a, key, now)}
