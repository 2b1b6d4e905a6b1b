#!lua
-- settle.lua: apply an outcome to an attempt, for Commit (the holder of the
-- attempt id) and Resolve (an operator, UNCERTAIN only). A repeat of the
-- outcome already recorded answers the same again (domain/ledger.rs:
-- Ledger::commit, Ledger::resolve, Ledger::settle).
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open       KEYS[4]  <prefix>:{P}:dup
-- KEYS[5]  <prefix>:{P}:held
-- KEYS[6]  <prefix>:uncertain:{T}:t:<tenant>  KEYS[7]  <prefix>:uncertain:{T}
--          (the uncertain index's shards of the permit: lib.lua)
-- KEYS[8]  <prefix>:{P}:pending    KEYS[9]  <prefix>:{P}:awaiting
-- KEYS[10] <prefix>:approvals:{T}:t:<tenant>  (the approvals index's shard:
--          the lapses due are written first, lib.lua: lapse)
-- ARGV[1]  now (ms; "" = Redis's clock)  ARGV[2]  idempotency key
-- ARGV[3]  attempt id, 16 bytes (for Resolve, "" settles whatever attempt
--          the key holds; required by the service with NotSent)
-- ARGV[4]  "succeeded" | "failed" | "not_sent"
-- ARGV[5]  result (succeeded) or reason (failed)
-- ARGV[6]  actual cost ("" = the reserved cost)
-- ARGV[7]  fresh receipt id (16 bytes, a UUIDv7; stamped with `now`, the
--          issue time)             ARGV[8]  "holder" | "operator"
-- ARGV[9]  retention (ms)
-- ARGV[10] the caller's tenant     ARGV[11] the caller's agent key id (""
--          = not limited): lib.lua, visible
--
-- Returns {"OK", attempt, usage}, or {"ERR", "PERMIT_NOT_FOUND"} |
-- {"ERR", "ATTEMPT_NOT_FOUND"} |
-- {"ERR", "ATTEMPT_MISMATCH"} | {"ERR", "ATTEMPT_HOLDER_MISMATCH"} (a
-- holder's Commit from an agent key that did not reserve it: lib.lua,
-- held_by) | {"ERR", "ATTEMPT_STATE_CONFLICT", state} |
-- {"ERR", "INVALID_REQUEST", "succeeded.actual_cost", description} (more
-- than the reserved cost) | {"ERR", "STORE_UNAVAILABLE", why}: a record
-- this version does not write (a permit field missing or not as atmost
-- writes it, the attempt record of another shape, a guard pointer that is
-- no key, a key of another type), records that disagree with the open
-- attempt (its member missing from the open or held set, the open count
-- not the open set's, less reserved than its cost, no slot counted), a
-- pending member that names no pending call, or the permit gone while its
-- attempts remain. Nothing is written then (but the lapses due, which are
-- written first: lib.lua, lapse). A call that needed approval settles as
-- any other once claimed (its approval kept); one still pending or denied
-- is a state conflict.
-- Example: ARGV={"1767225600000","order-42",<uuid>,"succeeded","ok","","<uuid>","holder","86400000"}

local now, key, outcome, payload = clock(ARGV[1]), ARGV[2], ARGV[4], ARGV[5]
local a = load_attempt(KEYS[2], key)
local tool = a and a.tool or ''
local p, refused = permit_for(KEYS, now, ARGV[10], ARGV[11], 'budget',
  'committed', 'reserved', 'n:' .. tool, 't:' .. tool, 'upol', 'appr')
if refused then
  return refused
end
-- The lapses due first (a call that needed approval and was not claimed
-- in time is DENIED, not settled).
local lapsed, unreadable = lapse(KEYS, p, now)
if not lapsed then
  return unreadable
end
if a and lapsed[key] then
  a = lapsed[key]
end
if a == false then
  return UNREADABLE_ATTEMPT
end
if not a then
  return {'ERR', 'ATTEMPT_NOT_FOUND'}
end
if (ARGV[8] == 'holder' or ARGV[3] ~= '') and a.id ~= ARGV[3] then
  return {'ERR', 'ATTEMPT_MISMATCH'}
end
if ARGV[8] == 'holder' and not held_by(a.by, ARGV[11]) then
  return {'ERR', 'ATTEMPT_HOLDER_MISMATCH'}
end
local state = observed_state(a, now)
local settleable
if ARGV[8] == 'holder' then
  settleable = state == RESERVED or state == UNCERTAIN
else
  settleable = state == UNCERTAIN
end
local actual = a.cost
if ARGV[6] ~= '' then
  actual = tonumber(ARGV[6])
end
-- The attempt exists, so its tool is in scope (t:<tool>) and was
-- authorized (n:<tool>). A field missing is never read as a default:
-- written back, it would move a cap, a budget or a pin.
local calls, cap = p['n:' .. tool], p['t:' .. tool]
local committed, reserved, open = p.committed, p.reserved, p.open
local hold = p.upol == true
if not (calls and cap) then
  return UNREADABLE_PERMIT
end

local function answer()
  return {'OK', attempt_reply(a, key, now),
    usage(tool, calls, cap, p.budget, committed, reserved)}
end

if not settleable then
  if outcome == 'succeeded' and state == SUCCEEDED
      and a.result == payload and a.actual == actual then
    return answer()
  elseif outcome == 'failed' and state == FAILED and a.failure == payload then
    return answer()
  elseif outcome == 'not_sent' and state == RELEASED then
    return answer()
  end
  return {'ERR', 'ATTEMPT_STATE_CONFLICT', state}
end

-- The attempt is open and may be settled; check before writing.
if outcome == 'succeeded' and actual > a.cost then
  return {'ERR', 'INVALID_REQUEST', 'succeeded.actual_cost',
    'may not exceed the reserved cost ' .. int(a.cost)}
end
if outcome == 'not_sent' and ARGV[8] == 'holder' and state ~= RESERVED then
  -- An uncertain call may have left: its slot stays held, until an
  -- operator verifies it never took effect (Resolve NotSent).
  return {'ERR', 'ATTEMPT_STATE_CONFLICT', state}
end
-- What is written below must agree with this open attempt: its members
-- in the open (and held) set, the open count the open set's size (it
-- decides whether the keys are unpinned), its cost reserved, its slot
-- counted; and the guard's pointer, a key.
if not open_has(KEYS, hold, a, key) then
  return OPEN_SET_DISAGREES
end
if not index_ready(KEYS) then
  return INDEX_OF_ANOTHER_TYPE
end
if redis.call('ZCARD', KEYS[3]) ~= open or reserved < a.cost or calls < 1 then
  return {'ERR', 'STORE_UNAVAILABLE', 'permit counters disagree with its open attempts'}
end
local dup_key, pointer
if outcome == 'not_sent' then
  dup_key = dup_field(a.tool, a.fp)
  pointer = redis.call('HGET', KEYS[4], dup_key)
  if pointer and not valid(pointer, 255, KEY) then
    return {'ERR', 'STORE_UNAVAILABLE', 'duplicate guard pointer is not a key'}
  end
end

open_del(KEYS, hold, a, key, open_at(a))
reserved = reserved - a.cost
if outcome == 'succeeded' then
  committed = committed + actual
  a.state, a.receipt_id, a.result, a.actual, a.issued =
    SUCCEEDED, stamp(ARGV[7], now), payload, actual, now
elseif outcome == 'failed' then
  a.state, a.failure = FAILED, payload
else
  a.state = RELEASED
  calls = calls - 1
  if pointer == key then
    if a.dup_of ~= '' then
      redis.call('HSET', KEYS[4], dup_key, a.dup_of)
    else
      redis.call('HDEL', KEYS[4], dup_key)
    end
  end
end
-- Settled: no longer RESERVED, so its token redelivers nothing.
a.token, a.usince = '', 0
save_attempt(KEYS[2], key, a)
open = open - 1
if open == 0 then
  local at = forget_at(p.exp, tonumber(ARGV[9]), now)
  redis.call('HSET', KEYS[1], 'reserved', int(reserved), 'committed',
    int(committed), 'n:' .. tool, int(calls), 'open', '0', 'fa', at)
  unpin(KEYS, at, p.appr)
else
  redis.call('HSET', KEYS[1], 'reserved', int(reserved), 'committed',
    int(committed), 'n:' .. tool, int(calls), 'open', int(open))
end
return answer()
