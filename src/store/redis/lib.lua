-- lib.lua: helpers prepended to every atmost script (each script is sent as
-- lib.lua .. script.lua, so it stays one atomic EVALSHA).
--
-- Keys of one permit P (all share the hash tag, so one Cluster slot):
--   <prefix>:{P}:permit    HASH  the permit and its usage counters:
--       subject, currency, tools ("\n"-joined), exp, lease, gmode, gwin,
--       status, created, budget (absent = unlimited),
--       t:<tool> (in scope; value = cap, "" = no cap), n:<tool> (slots held),
--       committed, reserved, open (number of RESERVED/UNCERTAIN attempts)
--   <prefix>:{P}:attempts  HASH  idempotency key -> attempt (cmsgpack array;
--       attempt and receipt ids as their 16 raw bytes)
--   <prefix>:{P}:open      ZSET  keys of RESERVED/UNCERTAIN attempts (score 0)
--   <prefix>:{P}:dup       HASH  tool .. "\n" .. first 8 bytes of the
--       fingerprint -> latest key (a pointer, checked against the attempt's
--       full fingerprint on every read)
--
-- Every script validates everything before its first write (Lua has no
-- rollback) and returns business outcomes as values: {"ERR", REASON, ...}.
-- Amounts are passed to Redis as strings formatted with %d, never as Lua
-- numbers (which Redis would print as 1e+15).

local RESERVED, SUCCEEDED, FAILED, UNCERTAIN, RELEASED = 1, 2, 3, 4, 5
local GUARD_OFF, GUARD_ENFORCE = 0, 2
local STATUS_REVOKED = 2
-- The accounting ceiling (domain::MAX_AMOUNT): every amount, total and cap
-- stays below 2^53, where Lua numbers (doubles) are exact.
local MAX_AMOUNT = '9007199254740991'

local function int(n)
  return string.format('%d', n)
end

-- Attempt record, as a cmsgpack array in this order.
local function load_attempt(attempts_key, key)
  local raw = redis.call('HGET', attempts_key, key)
  if not raw then
    return nil
  end
  local t = cmsgpack.unpack(raw)
  return {
    id = t[1], tool = t[2], fp = t[3], cost = t[4], state = t[5],
    created = t[6], lease = t[7], receipt_id = t[8], result = t[9],
    actual = t[10], issued = t[11], failure = t[12], ureason = t[13],
    dup_of = t[14],
  }
end

local function save_attempt(attempts_key, key, a)
  redis.call('HSET', attempts_key, key, cmsgpack.pack({
    a.id, a.tool, a.fp, a.cost, a.state, a.created, a.lease, a.receipt_id,
    a.result, a.actual, a.issued, a.failure, a.ureason, a.dup_of,
  }))
end

-- A RESERVED attempt whose lease has passed IS uncertain, for every reader.
local function observed_state(a, now)
  if a.state == RESERVED and now >= a.lease then
    return UNCERTAIN, 'lease_expired'
  end
  return a.state, a.ureason
end

-- The attempt as the service decodes it (store/redis.rs: decode_attempt).
local function attempt_reply(a, key, now)
  local state, reason = observed_state(a, now)
  return {
    a.id, a.tool, a.fp, int(a.cost), state, int(a.created), int(a.lease),
    a.receipt_id, a.result, int(a.actual), int(a.issued), a.failure, reason,
    key,
  }
end

-- Usage of one tool: {tool, calls_made, has_limit, limit, has_budget, remaining}.
-- The duplicate guard's index field: the tool and a fingerprint prefix.
local function dup_field(tool, fp)
  return tool .. '\n' .. string.sub(fp, 1, 8)
end

local function usage_reply(permit_key, tool)
  local u = redis.call('HMGET', permit_key, 'n:' .. tool, 't:' .. tool,
    'budget', 'committed', 'reserved')
  local limit = u[2] and tonumber(u[2])
  local remaining = 0
  if u[3] then
    remaining = tonumber(u[3]) - tonumber(u[4] or 0) - tonumber(u[5] or 0)
  end
  return {
    tool, int(tonumber(u[1] or 0)), limit and 1 or 0, int(limit or 0),
    u[3] and 1 or 0, int(remaining),
  }
end

-- Open attempts pin the permit's keys; once none is open they expire
-- `retention` ms after the permit does, or after `now` if that is later (so
-- an attempt settled long after expiry is still kept for `retention`).
-- Expiry itself runs on Redis's clock.
local function pin(keys)
  for i = 1, #keys do
    redis.call('PERSIST', keys[i])
  end
end

local function unpin(keys, permit_key, retention, now)
  local exp = math.max(tonumber(redis.call('HGET', permit_key, 'exp')), now)
  for i = 1, #keys do
    redis.call('PEXPIREAT', keys[i], int(exp + retention))
  end
end
