-- lib.lua: helpers prepended to every atmost script. Each script is sent as
-- lib.lua, then its body as `local function main()`, then
-- `return cmsgpack.pack(main())` (store/redis/scripts.rs: script_text): one
-- atomic EVALSHA whose reply is one msgpack string of what the body returns.
--
-- Keys of one permit P (all share the hash tag, so one Cluster slot):
--   <prefix>:{P}:permit    HASH  the permit and its usage counters:
--       subject, currency, tools ("\n"-joined), exp, lease, gmode, gwin,
--       status, created, budget (absent = unlimited), upol (uncertain
--       policy: absent = count, 1 = hold the tool),
--       t:<tool> (in scope; value = cap, "" = no cap), n:<tool> (slots held),
--       committed, reserved, open (number of RESERVED/UNCERTAIN attempts),
--       fa (when the permit is forgotten once nothing is open: set at
--       creation and whenever open drops to 0; void while open > 0),
--       closed (set when it leaves the cross-permit index: close_permit.lua),
--       ten (its tenant; absent = ""), agents (agent key ids that may use
--       it, "\n"-joined; absent = any)
--   <prefix>:{P}:attempts  HASH  idempotency key -> attempt (cmsgpack array;
--       attempt and receipt ids as their 16 raw bytes; see save_attempt)
--   <prefix>:{P}:open      ZSET  RESERVED/UNCERTAIN attempts, all score 0,
--       member "<at>:<key>" with at (15 digits) when the attempt is or
--       became uncertain: those uncertain at `now` are one ZRANGEBYLEX
--   <prefix>:{P}:held      ZSET  with upol = 1 only: the same, member
--       "<tool>\n<at>:<key>", so a tool's earliest is one ZRANGEBYLEX
--   <prefix>:{P}:dup       HASH  48-bit hash of tool and fingerprint ->
--       latest key (a pointer, checked against the attempt's tool and full
--       fingerprint on every read, so a collision only loses a pointer)
--
-- Keys across permits (no hash tag: each is one key, in a slot of its own;
-- no script touches two of them, nor one of them and a permit's keys):
--   <prefix>:permits[:<tenant>]  ZSET  a tenant's cross-permit index (dev
--       mode's tenant "": no suffix), all score 0, member
--       "<expires_at, 15 digits>:<permit id>": the permits that may hold an
--       open attempt (index_permit.lua adds them; the sweep and
--       ListUncertain drop a permit once close_permit.lua has closed it)
--   <prefix>:tenants  ZSET  the tenants whose index may hold a permit, all
--       score 0, one member "<tenant>\n<token>" each (index_tenant.lua;
--       the token is the id of the tenant's latest permit): the sweep and
--       the census walk it by lex, and the sweep removes a member whose
--       tenant's index it saw empty (store/redis.rs: Store::sweep)
--
-- Time: ARGV[1] of every script is "" and the script reads Redis's clock
-- (TIME), the one clock every replica shares; tests with an injected clock
-- pass their time instead (store/redis/conn.rs: Time). Ids made by the
-- service are stamped with the script's time (stamp).
--
-- Every script validates everything before its first write (Lua has no
-- rollback) and returns business outcomes as values: {"OK", ...} (or
-- Authorize's "DISPATCH"/"REPLAY"), or {"ERR", REASON, ...} where REASON is
-- the domain's name for it, the one clients see (domain/error.rs: Reason;
-- store/redis/reply.rs: open decodes the fields after it).
-- Amounts are passed to Redis as strings formatted with %d, never as Lua
-- numbers (which Redis would print as 1e+15).

local RESERVED, SUCCEEDED, FAILED, UNCERTAIN, RELEASED = 1, 2, 3, 4, 5
local GUARD_OFF, GUARD_LOG, GUARD_ENFORCE = 0, 1, 2
local STATUS_ACTIVE, STATUS_REVOKED = 1, 2
-- The accounting ceiling (domain::MAX_AMOUNT): every amount, total and cap
-- stays below 2^53, where Lua numbers (doubles) are exact.
local MAX_AMOUNT = '9007199254740991'

local function int(n)
  return string.format('%d', n)
end

-- The script's `now` in ms: Redis's clock, or the time the caller passed.
local function clock(arg)
  if arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A fresh UUIDv7 id (16 bytes) with its timestamp set to `ms`, so an
-- attempt's creation time and a receipt's issue time are the script's.
local function stamp(id, ms)
  local hi, lo = math.floor(ms / 4294967296), ms % 4294967296
  return string.char(math.floor(hi / 256), hi % 256, math.floor(lo / 16777216),
    math.floor(lo / 65536) % 256, math.floor(lo / 256) % 256, lo % 256)
    .. string.sub(id, 7)
end

-- A time as a fixed-width sort key (15 digits reach year 9999).
local function at15(ms)
  return string.format('%015d', ms)
end

-- The millisecond timestamp of a UUIDv7 (its first 48 bits, big-endian).
-- Attempt and receipt ids are stamped with the script's time at creation
-- and at issue (stamp), so the record need not repeat those times.
local function id_ms(id)
  local b1, b2, b3, b4, b5, b6 = string.byte(id, 1, 6)
  return ((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6
end

-- Attempt record, a cmsgpack array: id, tool, fp, cost, state, lease - created,
-- receipt_id, result, actual, failure, ureason, dup_of, token (the holder
-- token, kept only while RESERVED), usince (when a marked UNCERTAIN attempt
-- became so), by (the key id whose Authorize reserved it; '' in dev mode,
-- and for records made before it was recorded), with trailing empty values
-- ('' or 0) left off. created and issued come from the ids.
local function load_attempt(attempts_key, key)
  local raw = redis.call('HGET', attempts_key, key)
  if not raw then
    return nil
  end
  local t = cmsgpack.unpack(raw)
  local created, receipt_id = id_ms(t[1]), t[7] or ''
  return {
    id = t[1], tool = t[2], fp = t[3], cost = t[4], state = t[5],
    created = created, lease = created + t[6], receipt_id = receipt_id,
    result = t[8] or '', actual = t[9] or 0,
    issued = receipt_id ~= '' and id_ms(receipt_id) or 0,
    failure = t[10] or '', ureason = t[11] or '', dup_of = t[12] or '',
    token = t[13] or '', usince = t[14] or 0, by = t[15] or '',
  }
end

local function save_attempt(attempts_key, key, a)
  local t = {
    a.id, a.tool, a.fp, a.cost, a.state, a.lease - a.created, a.receipt_id,
    a.result, a.actual, a.failure, a.ureason, a.dup_of, a.token, a.usince,
    a.by,
  }
  local n = #t
  while n > 6 and (t[n] == '' or t[n] == 0) do
    t[n] = nil
    n = n - 1
  end
  redis.call('HSET', attempts_key, key, cmsgpack.pack(t))
end

-- A RESERVED attempt whose lease has passed IS uncertain, for every reader.
local function observed_state(a, now)
  if a.state == RESERVED and now >= a.lease then
    return UNCERTAIN, 'lease_expired'
  end
  return a.state, a.ureason
end

-- When an open attempt is (or became) uncertain: its place in the open set.
local function open_at(a)
  if a.state == UNCERTAIN then
    return a.usince
  end
  return a.lease
end

-- The attempt as the service decodes it (store/redis/reply.rs:
-- decode_attempt).
local function attempt_reply(a, key, now)
  local state, reason = observed_state(a, now)
  local since = 0
  if state == UNCERTAIN then
    since = open_at(a)
  end
  return {
    a.id, a.tool, a.fp, int(a.cost), state, int(a.created), int(a.lease),
    a.receipt_id, a.result, int(a.actual), int(a.issued), a.failure, reason,
    key, int(since), a.by,
  }
end

-- Whether the caller whose agent key id is `agent` holds an attempt
-- reserved by `by` (domain: Scope::holds): a caller no agents list limits
-- (agent "") holds every attempt; an agent key, those its own key
-- reserved, and those reserved by '' (dev mode, or recorded before the
-- holder was).
local function held_by(by, agent)
  return agent == '' or by == '' or by == agent
end

-- The open set (keys[3]) and, under the hold-tool policy, the held set
-- (keys[5]): add or remove an open attempt at `at`.
local function open_add(keys, hold, a, key, at)
  redis.call('ZADD', keys[3], 0, at15(at) .. ':' .. key)
  if hold then
    redis.call('ZADD', keys[5], 0, a.tool .. '\n' .. at15(at) .. ':' .. key)
  end
end

local function open_del(keys, hold, a, key, at)
  redis.call('ZREM', keys[3], at15(at) .. ':' .. key)
  if hold then
    redis.call('ZREM', keys[5], a.tool .. '\n' .. at15(at) .. ':' .. key)
  end
end

-- Whether the permit's uncertain policy holds tools: upol absent (count) or
-- "1" (hold); nil for a code this version does not know.
local function holds(upol)
  if not upol then
    return false
  elseif upol == '1' then
    return true
  end
  return nil
end

-- Whether a permit hash read at `now` is forgotten: nothing is open and its
-- retention ran out (fa), though Redis may not have expired its keys yet
-- (with a caller's clock; on Redis's own clock both happen at the same
-- instant).
local function forgotten(fa, open, now)
  return fa and tonumber(open) == 0 and now > tonumber(fa)
end

-- The duplicate guard's index field: 48 bits of SHA-1 over the tool and the
-- fingerprint (12 characters: the smallest allocation Redis makes for it).
local function dup_field(tool, fp)
  return string.sub(redis.sha1hex(tool .. '\n' .. fp), 1, 12)
end

-- Usage of one tool, from the permit's fields as read or about to be written:
-- {tool, calls_made, has_limit, limit, has_budget, remaining}. cap is the
-- t:<tool> value ('' = no cap), budget nil when unlimited.
local function usage(tool, calls, cap, budget, committed, reserved)
  local limit = cap ~= '' and tonumber(cap)
  local remaining = 0
  if budget then
    remaining = tonumber(budget) - committed - reserved
  end
  return {
    tool, int(calls), limit and 1 or 0, int(limit or 0),
    budget and 1 or 0, int(remaining),
  }
end

-- What a script answers for a permit hash that is not there (`exp`, read
-- from it, nil) or is forgotten: PERMIT_NOT_FOUND. All of a permit's keys
-- expire together, so a hash gone while its attempts remain is a lost
-- record (evicted, or deleted by hand): UNAVAILABLE, never a guess.
local function permit_not_found(exp, attempts_key)
  if not exp and redis.call('EXISTS', attempts_key) == 1 then
    return {'ERR', 'STORE_UNAVAILABLE', 'permit record lost while its attempts remain'}
  end
  return {'ERR', 'PERMIT_NOT_FOUND'}
end

-- Whether a caller may see the permit whose hash holds `ten` and `agents`:
-- the caller's tenant must be the permit's, and an agent's key id (agent,
-- "" when not limited) must be in the permit's agents when it names any.
-- If not, scripts answer PERMIT_NOT_FOUND, exactly as for a permit that
-- does not exist (domain: Permit::visible_to).
local function visible(ten, agents, tenant, agent)
  if (ten or '') ~= tenant then
    return false
  end
  if agent == '' or not agents then
    return true
  end
  for a in string.gmatch(agents, '[^\n]+') do
    if a == agent then
      return true
    end
  end
  return false
end

local NOT_VISIBLE = {'ERR', 'PERMIT_NOT_FOUND'}

-- What a script answers when the permit hash holds a code this version does
-- not know, or lacks a field it must have: never a default.
local UNREADABLE_PERMIT = {'ERR', 'STORE_UNAVAILABLE', 'unreadable permit record'}

-- The usage of one tool read from the permit hash, or nil when the hash
-- cannot be read (n:<tool> is absent until the tool's first Authorize).
local function usage_reply(permit_key, tool)
  local u = redis.call('HMGET', permit_key, 'n:' .. tool, 't:' .. tool,
    'budget', 'committed', 'reserved')
  local calls, committed, reserved = tonumber(u[1] or 0), tonumber(u[4]), tonumber(u[5])
  if not (calls and u[2] and committed and reserved) or (u[3] and not tonumber(u[3])) then
    return nil
  end
  return usage(tool, calls, u[2], u[3], committed, reserved)
end

-- Open attempts pin the permit's keys; once none is open they expire
-- `retention` ms after the permit does, or after `now` if that is later (so
-- an attempt settled long after expiry is still kept for `retention`):
-- forget_at, which the script also records as `fa` in the permit hash, so
-- every script forgets the permit then on any clock (memory store:
-- Ledger::forget_at). Only the permit, attempts and dup keys (KEYS 1, 2,
-- 4) carry a TTL: the open and held sets exist only while something is
-- open, and are made afresh, without one.
local function pin(keys)
  redis.call('PERSIST', keys[1])
  redis.call('PERSIST', keys[2])
  redis.call('PERSIST', keys[4])
end

local function forget_at(exp, retention, now)
  return int(math.max(exp, now) + retention)
end

local function unpin(keys, at)
  redis.call('PEXPIREAT', keys[1], at)
  redis.call('PEXPIREAT', keys[2], at)
  redis.call('PEXPIREAT', keys[4], at)
end
