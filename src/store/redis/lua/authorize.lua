#!lua
-- authorize.lua: the order of checks of one Authorize and, for a new key
-- that passes them, the reservation (domain/ledger.rs: Ledger::authorize).
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open       KEYS[4]  <prefix>:{P}:dup
-- KEYS[5]  <prefix>:{P}:held
-- KEYS[6]  <prefix>:uncertain:{T}:t:<tenant>  KEYS[7]  <prefix>:uncertain:{T}
--          (the uncertain index's shards of the permit: lib.lua)
-- KEYS[8]  <prefix>:{P}:pending    KEYS[9]  <prefix>:{P}:awaiting
-- KEYS[10] <prefix>:approvals:{T}:t:<tenant>  (the approvals index's shard)
-- ARGV[1]  now (ms; "" = Redis's clock)  ARGV[2]  tool
-- ARGV[3]  idempotency key         ARGV[4]  request fingerprint (bytes)
-- ARGV[5]  cost                    ARGV[6]  fresh attempt id (16 bytes, a
--          UUIDv7; stamped with `now`, the attempt's creation time)
-- ARGV[7]  holder token ("" = none)
-- ARGV[8]  the caller's tenant     ARGV[9]  the caller's agent key id ("" =
--          not limited): lib.lua, visible
-- ARGV[10] most open attempts a permit may hold (0 = no limit)
-- ARGV[11] most keys a permit may record (0 = no limit)
-- ARGV[12] the caller's key id ("" in dev mode): recorded as the attempt's
--          `by`; only that key (or a caller ARGV[9] does not limit) holds it
-- ARGV[13] the approval summary (stored with a call an approval rule holds)
--
-- Returns one of
--   {"DISPATCH", attempt, usage, duplicate_of or "", lease left (ms)}
--     a fresh reservation, or the requester's claim of its APPROVED call
--     (RESERVED from now, with this call's holder token)
--   {"AWAIT_APPROVAL", attempt, usage, duplicate_of or "", approval left
--     (ms)}  a new key the tool's approval rule holds (slot and cost
--     reserved, AWAITING_APPROVAL until its deadline), or the key's call
--     still waiting (its id left out unless the caller holds it; always,
--     for an APPROVED call the caller cannot claim)
--   {"REPLAY", attempt, usage, "", "0"}  the key's outcome (a DENIED
--     call's too); an open attempt's id is left out ("") unless the caller
--     holds it
--   {"REDELIVERED", attempt, usage, duplicate_of or "", lease left (ms)}
--     the same holder token's DISPATCH again, to the key that reserved
--     it: the attempt is RESERVED within its lease, nothing more reserved
--   {"ERR", "IDEMPOTENCY_KEY_REUSED"}
--   {"ERR", "IDEMPOTENCY_IN_PROGRESS", lease_expires_at, ms until then}
--   {"ERR", "PERMIT_NOT_FOUND"} | {"ERR", "PERMIT_REVOKED"}
--   {"ERR", "PERMIT_EXPIRED", expires_at} | {"ERR", "TOOL_NOT_IN_SCOPE"}
--   {"ERR", "TOOL_HELD_UNCERTAIN", uncertain_key}
--   {"ERR", "DUPLICATE_REQUEST_SUSPECTED", earlier_key}
--   {"ERR", "PERMIT_MAX_CALLS_EXCEEDED", limit, calls_made}
--   {"ERR", "PERMIT_BUDGET_EXCEEDED", budget, committed, reserved}
--   {"ERR", "QUOTA_OPEN_ATTEMPTS", limit} | {"ERR", "QUOTA_ATTEMPTS", limit}
--   {"ERR", "STORE_UNAVAILABLE", why}  a record this version does not
--     write: a permit field missing or not as atmost writes it (a number
--     with %d, a status, guard mode or policy it knows), an attempt record
--     (the key's, or the one the guard's pointer names) of another shape,
--     a pointer that names no attempt, a held member that names no
--     uncertain attempt, a pending member that names no pending call, a
--     key of another type; or the permit gone while its attempts are not.
--     Nothing is written then (but the lapses due, which every Authorize writes
--     first, as every transition does: lib.lua, lapse).
-- Example: ARGV={"1767225600000","payments.charge","order-42",<32 bytes>,"250",<uuid>,"",
--   "acme","agent-7","0","0","agent-7",""}
--   -> {"DISPATCH", {<uuid>,"payments.charge",...}, {"payments.charge","1",1,"3",1,"750"}, "",
--   "30000"}

local now = clock(ARGV[1])
local tool, key, fp = ARGV[2], ARGV[3], ARGV[4]
local cost = tonumber(ARGV[5])

-- Every field read, and each one checked, before anything else.
local p, refused = permit_for(KEYS, now, ARGV[8], ARGV[9], 'status', 'lease',
  'gmode', 'gwin', 'budget', 'committed', 'reserved', 't:' .. tool,
  'n:' .. tool, 'upol', 'closed', 'appr', 'ap:' .. tool)
if refused then
  return refused
end
-- A rule on a permit that does not say it has one (appr): not written so.
local rule = p['ap:' .. tool]
if rule and not p.appr then
  return UNREADABLE_PERMIT
end
-- n:<tool> is absent until the tool's first Authorize; t:<tool>, for a
-- tool out of scope.
local cap, calls = p['t:' .. tool], p['n:' .. tool] or 0
local committed, reserved, open = p.committed, p.reserved, p.open
local hold = p.upol == true

-- Calls whose approval lapsed return their slots before anything is read:
-- every answer's usage counts only what is held at `now` (Ledger::authorize).
local lapsed, unreadable = lapse(KEYS, p, now)
if not lapsed then
  return unreadable
end
calls, reserved = p['n:' .. tool] or 0, p.reserved

-- The tool's earliest open attempt, if the permit holds tools (HOLD_TOOL)
-- and it is uncertain at `now`: the refusal (or the store's complaint).
local function tool_held()
  if not hold then
    return nil
  end
  local first = redis.call('ZRANGEBYLEX', KEYS[5], '[' .. tool .. '\n',
    '(' .. tool .. '\n' .. at15(now + 1), 'LIMIT', 0, 1)[1]
  if first then
    local _, held = uncertain_member(KEYS[2], first, tool, now)
    if not held then
      return OPEN_SET_DISAGREES
    end
    return {'ERR', 'TOOL_HELD_UNCERTAIN', held}
  end
  return nil
end

-- 1. The key exists (and was not released): replay, in progress, reused,
--    waiting for approval, or its approved call claimed.
local existing = load_attempt(KEYS[2], key)
if existing == false then
  return UNREADABLE_ATTEMPT
end
if existing and existing.state ~= RELEASED then
  if existing.tool ~= tool or existing.fp ~= fp or existing.cost ~= cost then
    return {'ERR', 'IDEMPOTENCY_KEY_REUSED'}
  end
  local mine = held_by(existing.by, ARGV[9])
  local state = observed_state(existing, now)
  if state == RESERVED then
    if not mine or ARGV[7] == '' or existing.token ~= ARGV[7] then
      return {'ERR', 'IDEMPOTENCY_IN_PROGRESS', int(existing.lease),
        int(existing.lease - now)}
    end
  end
  -- The attempt exists, so its tool is in scope.
  if not cap then
    return UNREADABLE_PERMIT
  end
  local u = usage(tool, calls, cap, p.budget, committed, reserved)
  if state == AWAITING or (state == APPROVED and not mine) then
    -- Waiting for a person, or for its own requester to claim it.
    local reply = attempt_reply(existing, key, now)
    if not mine then
      reply[1] = ''
    end
    return {'AWAIT_APPROVAL', reply, u, '', int(existing.lease - now)}
  end
  if state == APPROVED then
    -- Its requester claims it: RESERVED from now, held by this call's
    -- token, its one DISPATCH (domain: Ledger::claim). A held tool holds
    -- it as it holds a new key: it stays APPROVED.
    local held = tool_held()
    if held then
      return held
    end
    local member = at15(existing.lease) .. ':' .. key
    if not redis.call('ZSCORE', KEYS[8], member) then
      return PENDING_SET_DISAGREES
    end
    if not index_ready(KEYS) then
      return INDEX_OF_ANOTHER_TYPE
    end
    local a = existing
    a.state, a.lease, a.token = RESERVED, now + p.lease, ARGV[7]
    open_add(KEYS, hold, a, key, a.lease)
    redis.call('ZREM', KEYS[8], member)
    save_attempt(KEYS[2], key, a)
    open = open + 1
    redis.call('HSET', KEYS[1], 'open', int(open))
    if open == 1 then
      pin(KEYS, p.appr)
    end
    return {'DISPATCH', attempt_reply(a, key, now), u, a.dup_of, int(p.lease)}
  end
  local reply = attempt_reply(existing, key, now)
  if state == RESERVED then
    -- The same holder, whose DISPATCH answer was lost: the same attempt.
    return {'REDELIVERED', reply, u, existing.dup_of,
      int(existing.lease - now)}
  end
  -- An open attempt's id is the fencing token of its Commit and
  -- MarkUncertain: it goes only to the caller holding it.
  if state == UNCERTAIN and not mine then
    reply[1] = ''
  end
  return {'REPLAY', reply, u, '', '0'}
end

-- 2. A new key (the lapses due written above): found -> not revoked ->
--    not expired -> in scope -> not held -> duplicate guard -> cap ->
--    budget -> quotas.
if p.status == STATUS_REVOKED then
  return {'ERR', 'PERMIT_REVOKED'}
end
-- Closed: expired past the index margin and gone from the cross-permit
-- index (close_permit.lua); expired on any later reading of the clock.
if now >= p.exp or p.closed then
  return {'ERR', 'PERMIT_EXPIRED', int(p.exp)}
end
if not cap then
  return {'ERR', 'TOOL_NOT_IN_SCOPE'}
end
local held = tool_held()
if held then
  return held
end
local dup_key
local duplicate_of = ''
if p.gmode ~= GUARD_OFF then
  dup_key = dup_field(tool, fp)
  local earlier_key = redis.call('HGET', KEYS[4], dup_key)
  if earlier_key then
    -- A pointer names a key whose attempt is there (after a collision,
    -- another tool's or request's: checked below).
    local earlier = valid(earlier_key, 255, KEY) and load_attempt(KEYS[2], earlier_key)
    if not earlier then
      return {'ERR', 'STORE_UNAVAILABLE', 'duplicate guard names no readable attempt'}
    end
    local was = observed_state(earlier, now)
    if earlier.tool == tool and earlier.fp == fp
        and was ~= RELEASED and was ~= DENIED
        -- A call waiting for a person is as live as the moment it asked.
        and (is_pending(was) or now - earlier.created < p.gwin) then
      if p.gmode == GUARD_ENFORCE then
        return {'ERR', 'DUPLICATE_REQUEST_SUSPECTED', earlier_key}
      end
      duplicate_of = earlier_key
    end
  end
end
if cap ~= '' and calls >= cap then
  return {'ERR', 'PERMIT_MAX_CALLS_EXCEEDED', int(cap), int(calls)}
end
-- Without a budget, totals still stop at the accounting ceiling 2^53-1.
local budget = p.budget or MAX_AMOUNT
if committed + reserved + cost > budget then
  return {'ERR', 'PERMIT_BUDGET_EXCEEDED', int(budget), int(committed),
    int(reserved)}
end
-- Last, the quotas: calls waiting on approval count as open; a released
-- key re-reserved is no new record.
local max_open, max_keys = tonumber(ARGV[10]), tonumber(ARGV[11])
local pending = 0
if p.appr then
  pending = redis.call('ZCARD', KEYS[8])
end
if max_open > 0 and open + pending >= max_open then
  return {'ERR', 'QUOTA_OPEN_ATTEMPTS', ARGV[10]}
end
if max_keys > 0 and not existing and redis.call('HLEN', KEYS[2]) >= max_keys then
  return {'ERR', 'QUOTA_ATTEMPTS', ARGV[11]}
end

-- Everything checked: reserve the slot and the cost, record the attempt.
-- The open set is written first: with the uncertain index, the keys not
-- read above, so one of another type fails this first write (or the
-- index's check), before anything has changed.
if not index_ready(KEYS) then
  return INDEX_OF_ANOTHER_TYPE
end
local a = {
  id = stamp(ARGV[6], now), tool = tool, fp = fp, cost = cost,
  state = RESERVED, created = now, lease = now + p.lease, receipt_id = '',
  result = '', actual = 0, issued = 0, failure = '', ureason = '',
  dup_of = duplicate_of, token = ARGV[7], usince = 0, by = ARGV[12],
}
local waits = rule and (not rule.at or cost >= rule.at)
if waits then
  -- The tool's approval rule holds it: the same reservation, but
  -- AWAITING_APPROVAL until its deadline (no lease, no token: nothing may
  -- be sent), in the pending and awaiting sets and the approvals index.
  if not approvals_ready(KEYS) then
    return APPROVALS_OF_ANOTHER_TYPE
  end
  local deadline = math.min(now + rule.wait, p.exp)
  a.state, a.lease, a.token = AWAITING, deadline, ''
  a.ap = {
    summary = ARGV[13], expires = deadline, needed = rule.approvers,
    approved = {}, by = '', at = 0, reason = '',
  }
  redis.call('ZADD', KEYS[8], 0, at15(deadline) .. ':' .. key)
  redis.call('ZADD', KEYS[9], 0, at15(now) .. ':' .. key)
  redis.call('ZADD', KEYS[10], 0, index_member(KEYS, now, key))
else
  open_add(KEYS, hold, a, key, a.lease)
end
save_attempt(KEYS[2], key, a)
if dup_key then
  redis.call('HSET', KEYS[4], dup_key, key)
end
calls, reserved = calls + 1, reserved + cost
local u = usage(tool, calls, cap, p.budget, committed, reserved)
if waits then
  redis.call('HSET', KEYS[1], 'n:' .. tool, int(calls), 'reserved', int(reserved))
  if open == 0 then
    -- Nothing open: the keys this may have made expire with the permit's.
    unpin(KEYS, int(p.fa), true)
  end
  return {'AWAIT_APPROVAL', attempt_reply(a, key, now), u, duplicate_of,
    int(a.lease - now)}
end
open = open + 1
redis.call('HSET', KEYS[1], 'n:' .. tool, int(calls), 'reserved', int(reserved),
  'open', int(open))
if open == 1 then
  pin(KEYS, p.appr)
end
return {'DISPATCH', attempt_reply(a, key, now), u, duplicate_of, int(p.lease)}
