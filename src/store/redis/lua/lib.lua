-- lib.lua: helpers shared by every atmost script. atmost's Redis Functions
-- library is lib.lua once, then each script's body as
-- `local function script_<name>(KEYS, ARGV)`, each registered as a function
-- whose reply is one msgpack string of what the body returns
-- (store/redis/scripts.rs: library_text); each call is one atomic FCALL.
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
--       it, "\n"-joined; absent = any),
--       appr ("1" when the permit has an approval rule; absent = none: no
--       script then reads the pending set), ap:<tool> (the tool's approval
--       rule: "<cost_at_least>:<wait ms>:<approvers>", cost_at_least ""
--       for every call, wait 1 ms to 7 days, approvers 1 or 2)
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
--   <prefix>:{P}:pending   ZSET  AWAITING_APPROVAL and APPROVED attempts,
--       all score 0, member "<deadline>:<key>" (15 digits, the attempt's
--       lease field while pending): those past their deadline at `now` are
--       one ZRANGEBYLEX, and every transition first writes their lapse
--       (DENIED: pending_read, pending_write); its size counts toward the
--       open-attempts quota
--   <prefix>:{P}:awaiting  ZSET  AWAITING_APPROVAL attempts, all score 0,
--       member "<created>:<key>": ListApprovals' order (list_approvals.lua);
--       one whose request lapsed stays until its lapse is written
-- A permit without approval rules (no appr) never has either; both live
-- and expire with the permit's other keys (pin, unpin).
--
-- The uncertain index, sharded by hash tag {T} (one shard outside a
-- Cluster; on a Cluster, T is a tag in the permit's own slot, so a
-- permit's scripts write its shard atomically: store/redis.rs, Shards):
--   <prefix>:uncertain:{T}   ZSET  every RESERVED or UNCERTAIN attempt of
--       the permits in the shard, all score 0, member
--       "<at, 15 digits>:<permit id>:<key>", at as in the open set: those
--       uncertain at `now` are one ZRANGEBYLEX, their number a ZLEXCOUNT
--       (census.lua)
--   <prefix>:uncertain:{T}:t:<tenant>  ZSET  the same, one tenant's
--       (list_index.lua: ListUncertain across permits)
--   <prefix>:approvals:{T}:t:<tenant>  ZSET  every AWAITING_APPROVAL attempt
--       of the tenant's permits in the shard, all score 0, member
--       "<created, 15 digits>:<permit id>:<key>" (list_index.lua and
--       awaiting_attempts.lua: ListApprovals across permits). An entry
--       leaves with its attempt's approval, denial or written lapse; the
--       sweep drops those of a permit it closes (close_permit.lua), whose
--       requests have all lapsed. (A permit forgotten before the sweep
--       closes it, with a retention shorter than the index margin, leaves
--       the entries of requests that lapsed unwritten: listings skip them,
--       as they skip every entry of a permit that is gone.)
--
-- The scripts that move attempts take the permit's keys in one order:
-- KEYS[1] permit, [2] attempts, [3] open, [4] dup, [5] held, [6] the
-- tenant's uncertain shard, [7] the fleet's, [8] pending, [9] awaiting,
-- [10] the tenant's approvals shard (the helpers below use these indexes).
--
-- Keys across permits (no hash tag: each is one key, in a slot of its own;
-- no script touches two of them, nor one of them and a permit's keys):
--   <prefix>:permits[:<tenant>]  ZSET  a tenant's permits index (dev
--       mode's tenant "": no suffix), all score 0, member
--       "<expires_at, 15 digits>:<permit id>": the permits that may hold an
--       open attempt, counted for the tenant's permit quota
--       (index_permit.lua adds them; the sweep drops a permit once
--       close_permit.lua has closed it)
--   <prefix>:tenants  ZSET  the tenants whose index may hold a permit, all
--       score 0, one member "<tenant>\n<token>" each (index_tenant.lua;
--       the token is the id of the tenant's latest permit): the sweep walks
--       it by lex, and removes a member whose tenant's index it saw empty
--       (store/redis.rs: Store::sweep)
--
-- Time: ARGV[1] of every script is "" and the script reads Redis's clock
-- (TIME), the one clock every replica shares; tests with an injected clock
-- pass their time instead (store/redis/conn.rs: Time). Ids made by the
-- service are stamped with the script's time (stamp).
--
-- Every script validates everything it reads before its first write (Lua
-- has no rollback): each permit field as atmost writes it (read_permit), an
-- attempt record whole (load_attempt), the set members and pointers it
-- follows, and that the keys it writes hold their type (each is read
-- first, or is the first written). What it cannot read is
-- {"ERR", "STORE_UNAVAILABLE", why}, never a default, and nothing is
-- written. Business outcomes are values: {"OK", ...} (or Authorize's
-- "DISPATCH"/"REPLAY"), or {"ERR", REASON, ...} where REASON is the
-- domain's name for it, the one clients see (domain/error.rs: Reason;
-- store/redis/reply.rs: open decodes the fields after it).
-- Amounts are passed to Redis as strings formatted with %d, never as Lua
-- numbers (which Redis would print as 1e+15).

local RESERVED, SUCCEEDED, FAILED, UNCERTAIN, RELEASED = 1, 2, 3, 4, 5
-- A call an approval rule holds: waiting, refused (or lapsed), approved and
-- not yet claimed (domain: AttemptState).
local AWAITING, DENIED, APPROVED = 6, 7, 8
local GUARD_OFF, GUARD_LOG, GUARD_ENFORCE = 0, 1, 2
local STATUS_ACTIVE, STATUS_REVOKED = 1, 2
-- The accounting ceiling (domain::MAX_AMOUNT): every amount, total and cap
-- stays below 2^53, where Lua numbers (doubles) are exact; so does every
-- number atmost stores (times, counts, durations).
local MAX_AMOUNT = 9007199254740991
-- The longest lease or guard window (domain::MAX_DURATION_MS).
local MAX_DURATION = 604800000
-- The longest approval summary (domain::MAX_SUMMARY_LEN).
local MAX_SUMMARY = 1024

local function int(n)
  return string.format('%d', n)
end

-- A stored number as atmost writes it (%d): "0" or digits without a
-- leading zero, at most MAX_AMOUNT; nil for anything else ("1e3", "1.5",
-- "-1", " 1", "01", "0x10", "", a missing field).
local function uint(s)
  if type(s) ~= 'string' or #s > 16
      or not (s == '0' or string.find(s, '^[1-9][0-9]*$')) then
    return nil
  end
  local n = tonumber(s)
  if n > MAX_AMOUNT then
    return nil
  end
  return n
end

-- A whole number in 0..=MAX_AMOUNT (a Lua number from a record).
local function whole(n)
  return type(n) == 'number' and n >= 0 and n <= MAX_AMOUNT and n == math.floor(n)
end

-- Names as the service checks them (domain.rs): 1 to `max` bytes, none
-- that `outside` matches. A KEY, an idempotency key: 1..=255 printable
-- ASCII; a NAME, a key id or tenant: 1..=64 of [A-Za-z0-9._-]; a TOOL:
-- 1..=128 of [A-Za-z0-9._:/-].
local KEY, NAME, TOOL = '[^\032-\126]', '[^A-Za-z0-9%._%-]', '[^A-Za-z0-9%._:/%-]'

local function valid(s, max, outside)
  return type(s) == 'string' and #s >= 1 and #s <= max
    and not string.find(s, outside)
end

-- Whether s is UTF-8 text, as the service decodes the text it is sent
-- (Rust's String: no overlong forms, surrogates or code points past
-- U+10FFFF).
local function utf8_text(s)
  if type(s) ~= 'string' then
    return false
  end
  if not string.find(s, '[\128-\255]') then
    return true
  end
  local i, n = 1, #s
  while i <= n do
    local c = string.byte(s, i)
    if c < 128 then
      i = i + 1
    else
      -- The sequence's length, and the range of its second byte.
      local len, lo, hi
      if c >= 0xC2 and c <= 0xDF then
        len, lo, hi = 2, 0x80, 0xBF
      elseif c == 0xE0 then
        len, lo, hi = 3, 0xA0, 0xBF
      elseif c == 0xED then
        len, lo, hi = 3, 0x80, 0x9F
      elseif c >= 0xE1 and c <= 0xEF then
        len, lo, hi = 3, 0x80, 0xBF
      elseif c == 0xF0 then
        len, lo, hi = 4, 0x90, 0xBF
      elseif c >= 0xF1 and c <= 0xF3 then
        len, lo, hi = 4, 0x80, 0xBF
      elseif c == 0xF4 then
        len, lo, hi = 4, 0x80, 0x8F
      else
        return false
      end
      local b = string.byte(s, i + 1)
      if not b or b < lo or b > hi then
        return false
      end
      for j = i + 2, i + len - 1 do
        b = string.byte(s, j)
        if not b or b < 0x80 or b > 0xBF then
          return false
        end
      end
      i = i + len
    end
  end
  return true
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
-- and for records made before it was recorded), ap (a call an approval
-- rule held: its request and outcome, kept once claimed and settled), with
-- trailing empty values ('' or 0) left off. created and issued come from
-- the ids. While AWAITING_APPROVAL or APPROVED, the lease is the pending
-- request's deadline (ap's expires).
--
-- ap is a cmsgpack array: summary, expires (the deadline: absolute ms),
-- approvers needed (1 or 2), approved_by (an array of key ids, '' in dev
-- mode), decided_by, decided_at (0: not yet), denial reason ('' unless
-- DENIED).
--
-- A record is read only as save_attempt writes it: one cmsgpack array that
-- packs back to the same bytes (no map, no hole, no other encoding,
-- nothing after it), of 6 to 16 elements, each of its type and range:
-- ids of 16 bytes, a tool, key, key id and text as the service checks
-- them, numbers whole, the state one this version knows, the lease 1 ms to
-- 7 days (longer only for a call that needed approval: a claim's lease
-- starts when it is claimed), the actual cost at most the cost, usince at
-- most the lease, ap as above and as the state needs it (a pending,
-- denied or approved call has one; a pending one's lease is its deadline).
-- load_attempt answers the attempt, nil when the key has none, or false
-- when its record cannot be read: scripts then answer UNREADABLE_ATTEMPT,
-- before anything is written.
local function read_approval(v, created)
  if type(v) ~= 'table' or #v ~= 7 then
    return nil
  end
  local summary, expires, needed, approved, by, at, reason = unpack(v, 1, 7)
  if not (utf8_text(summary) and #summary <= MAX_SUMMARY and whole(expires)
      and expires > created and (needed == 1 or needed == 2)
      and type(approved) == 'table' and #approved <= needed
      and (by == '' or valid(by, 64, NAME)) and whole(at) and utf8_text(reason)) then
    return nil
  end
  for _, k in ipairs(approved) do
    if not (k == '' or valid(k, 64, NAME)) then
      return nil
    end
  end
  return {
    summary = summary, expires = expires, needed = needed, approved = approved,
    by = by, at = at, reason = reason,
  }
end

local function read_attempt(raw)
  local ok, t = pcall(cmsgpack.unpack, raw)
  if not ok or type(t) ~= 'table' or cmsgpack.pack(t) ~= raw then
    return nil
  end
  local n = #t
  if n < 6 or n > 16 then
    return nil
  end
  local function at(i, empty)
    if i > n then
      return empty
    end
    return t[i]
  end
  local id, tool, fp, cost, state, lease = t[1], t[2], t[3], t[4], t[5], t[6]
  local receipt_id, result, actual = at(7, ''), at(8, ''), at(9, 0)
  local failure, ureason, dup_of = at(10, ''), at(11, ''), at(12, '')
  local token, usince, by = at(13, ''), at(14, 0), at(15, '')
  if not (type(id) == 'string' and #id == 16 and valid(tool, 128, TOOL)
      and type(fp) == 'string' and whole(cost)
      and whole(state) and state >= RESERVED and state <= APPROVED
      and whole(lease) and lease >= 1
      and type(receipt_id) == 'string' and (receipt_id == '' or #receipt_id == 16)
      and type(result) == 'string' and whole(actual) and actual <= cost
      and utf8_text(failure) and utf8_text(ureason)
      and (dup_of == '' or valid(dup_of, 255, KEY)) and type(token) == 'string'
      and whole(usince) and (by == '' or valid(by, 64, NAME))) then
    return nil
  end
  local created = id_ms(id)
  local ap
  if n == 16 then
    ap = read_approval(t[16], created)
    if not ap then
      return nil
    end
  end
  local pending = state == AWAITING or state == APPROVED
  if usince > created + lease or (lease > MAX_DURATION and not ap)
      or ((pending or state == DENIED) and not ap)
      or (pending and ap.expires ~= created + lease)
      or (state == AWAITING and #ap.approved >= ap.needed)
      or (ap and ap.reason ~= '' and state ~= DENIED) then
    return nil
  end
  return {
    id = id, tool = tool, fp = fp, cost = cost, state = state,
    created = created, lease = created + lease, receipt_id = receipt_id,
    result = result, actual = actual,
    issued = receipt_id ~= '' and id_ms(receipt_id) or 0,
    failure = failure, ureason = ureason, dup_of = dup_of,
    token = token, usince = usince, by = by, ap = ap,
  }
end

local function load_attempt(attempts_key, key)
  local raw = redis.call('HGET', attempts_key, key)
  if not raw then
    return nil
  end
  return read_attempt(raw) or false
end

local UNREADABLE_ATTEMPT = {'ERR', 'STORE_UNAVAILABLE', 'unreadable attempt record'}

local function save_attempt(attempts_key, key, a)
  local t = {
    a.id, a.tool, a.fp, a.cost, a.state, a.lease - a.created, a.receipt_id,
    a.result, a.actual, a.failure, a.ureason, a.dup_of, a.token, a.usince,
    a.by,
  }
  local ap = a.ap
  if ap then
    t[16] = {ap.summary, ap.expires, ap.needed, ap.approved, ap.by, ap.at, ap.reason}
  end
  local n = #t
  while n > 6 and (t[n] == '' or t[n] == 0) do
    t[n] = nil
    n = n - 1
  end
  redis.call('HSET', attempts_key, key, cmsgpack.pack(t))
end

-- Whether a call waits on a person (AWAITING_APPROVAL) or on its
-- requester's claim (APPROVED): it holds its slot and cost, and lapses at
-- its deadline (its lease field).
local function is_pending(state)
  return state == AWAITING or state == APPROVED
end

-- A RESERVED attempt whose lease has passed IS uncertain, for every reader;
-- a pending one past its deadline IS denied (domain: observe).
local function observed_state(a, now)
  if a.state == RESERVED and now >= a.lease then
    return UNCERTAIN, 'lease_expired'
  end
  if is_pending(a.state) and now >= a.lease then
    return DENIED, a.ureason
  end
  return a.state, a.ureason
end

-- Why a call pending in `state` is denied once its deadline has passed
-- (domain: lapse_reason).
local function lapse_reason(state)
  if state == APPROVED then
    return 'approval_unclaimed'
  end
  return 'approval_expired'
end

-- When an open attempt is (or became) uncertain: its place in the open set.
local function open_at(a)
  if a.state == UNCERTAIN then
    return a.usince
  end
  return a.lease
end

-- The attempt as the service decodes it (store/redis/reply.rs:
-- decode_attempt). A call that needed approval has one more element: its
-- approval {summary, expires, needed, approved_by, decided_by, decided_at,
-- denial reason}, as readers see it (a lapse reads as a denial at the
-- deadline, by nobody: domain, Attempt::into_observed). A pending or
-- denied call has no lease (0): it was never sent.
local function attempt_reply(a, key, now)
  local state, reason = observed_state(a, now)
  local since = 0
  if state == UNCERTAIN then
    since = open_at(a)
  end
  local lease = a.lease
  if is_pending(a.state) or a.state == DENIED then
    lease = 0
  end
  local reply = {
    a.id, a.tool, a.fp, int(a.cost), state, int(a.created), int(lease),
    a.receipt_id, a.result, int(a.actual), int(a.issued), a.failure, reason,
    key, int(since), a.by,
  }
  local ap = a.ap
  if ap then
    local by, at, why = ap.by, ap.at, ap.reason
    if state == DENIED and a.state ~= DENIED then
      by, at, why = '', ap.expires, lapse_reason(a.state)
    end
    reply[17] = {ap.summary, int(ap.expires), ap.needed, ap.approved, by, int(at), why}
  end
  return reply
end

-- Whether the caller whose agent key id is `agent` holds an attempt
-- reserved by `by` (domain: Scope::holds): a caller no agents list limits
-- (agent "") holds every attempt; an agent key, those its own key
-- reserved, and those reserved by '' (dev mode, or recorded before the
-- holder was).
local function held_by(by, agent)
  return agent == '' or by == '' or by == agent
end

-- An open attempt's member in the uncertain index (keys[6], the permit's
-- tenant's shard, and keys[7], the fleet's): "<at>:<permit id>:<key>",
-- the permit id read from its keys' hash tag.
local function index_member(keys, at, key)
  return at15(at) .. ':' .. string.match(keys[1], '{([^}]*)}') .. ':' .. key
end

-- Whether the uncertain index's keys (keys[6], keys[7]) are sorted sets or
-- absent: checked before a script's first write, since they are written
-- last and never read otherwise.
local function index_ready(keys)
  for i = 6, 7 do
    local n = redis.pcall('ZCARD', keys[i])
    if type(n) ~= 'number' then
      return false
    end
  end
  return true
end

local INDEX_OF_ANOTHER_TYPE = {'ERR', 'STORE_UNAVAILABLE', 'uncertain index of another type'}

-- The open set (keys[3]), under the hold-tool policy the held set
-- (keys[5]), and the uncertain index (keys[6], keys[7]): add or remove an
-- open attempt at `at`.
local function open_add(keys, hold, a, key, at)
  redis.call('ZADD', keys[3], 0, at15(at) .. ':' .. key)
  if hold then
    redis.call('ZADD', keys[5], 0, a.tool .. '\n' .. at15(at) .. ':' .. key)
  end
  local member = index_member(keys, at, key)
  redis.call('ZADD', keys[6], 0, member)
  redis.call('ZADD', keys[7], 0, member)
end

local function open_del(keys, hold, a, key, at)
  redis.call('ZREM', keys[3], at15(at) .. ':' .. key)
  if hold then
    redis.call('ZREM', keys[5], a.tool .. '\n' .. at15(at) .. ':' .. key)
  end
  local member = index_member(keys, at, key)
  redis.call('ZREM', keys[6], member)
  redis.call('ZREM', keys[7], member)
end

-- Whether a permit read at `now` (read_permit) is forgotten: nothing is
-- open and its retention ran out (fa), though Redis may not have expired
-- its keys yet (with a caller's clock; on Redis's own clock both happen at
-- the same instant).
local function forgotten(p, now)
  return p.open == 0 and now > p.fa
end

-- Whether the open attempt `a` of `key` is in its place in the open set
-- (keys[3]) and, under the hold-tool policy, the held set (keys[5]): read
-- before either is written, so sets that disagree with the attempt (or
-- keys of another type) are found while nothing has changed.
local function open_has(keys, hold, a, key)
  local member = at15(open_at(a)) .. ':' .. key
  return redis.call('ZSCORE', keys[3], member)
    and (not hold or redis.call('ZSCORE', keys[5], a.tool .. '\n' .. member))
end

-- The attempt an open-set member ("<at>:<key>"; in the held set,
-- "<tool>\n<at>:<key>", tool given) names, with its key, if that attempt
-- is uncertain at `now` and the member is its place; nil otherwise: the
-- records disagree (OPEN_SET_DISAGREES), and nothing is guessed.
local function uncertain_member(attempts_key, member, tool, now)
  local prefix = tool and (tool .. '\n') or ''
  local key = string.sub(member, #prefix + 17)
  if key == '' then
    return nil
  end
  local a = load_attempt(attempts_key, key)
  if not a or (tool and a.tool ~= tool) or observed_state(a, now) ~= UNCERTAIN
      or member ~= prefix .. at15(open_at(a)) .. ':' .. key then
    return nil
  end
  return a, key
end

local OPEN_SET_DISAGREES = {'ERR', 'STORE_UNAVAILABLE', 'open set disagrees with the attempts'}

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

local PERMIT_NOT_FOUND = {'ERR', 'PERMIT_NOT_FOUND'}
local NOT_VISIBLE = PERMIT_NOT_FOUND

-- What a script answers for a permit hash that is not there:
-- PERMIT_NOT_FOUND. All of a permit's keys expire together, so a hash gone
-- while its attempts remain is a lost record (evicted, or deleted by
-- hand): UNAVAILABLE, never a guess.
local function permit_not_found(attempts_key)
  if redis.call('EXISTS', attempts_key) == 1 then
    return {'ERR', 'STORE_UNAVAILABLE', 'permit record lost while its attempts remain'}
  end
  return PERMIT_NOT_FOUND
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

-- What a script answers when the permit hash holds a value this version
-- does not write, or lacks a field it must have: never a default.
local UNREADABLE_PERMIT = {'ERR', 'STORE_UNAVAILABLE', 'unreadable permit record'}

-- One permit field's value as the scripts use it, read as atmost writes
-- it (the fields above): a number with %d (uint), a lease or guard
-- window 1 ms to 7 days, a code this version knows (status, gmode; upol,
-- closed and appr "1", read as true), a cap "" (none) or a number, an
-- approval rule (a table: at, wait, approvers), a text field's string
-- (read whole by readable_record). nil when the field is absent; false
-- when it is not what atmost writes, or is absent and every permit has it
-- (all but budget, upol, closed, ten, agents, appr, t:<tool>, n:<tool>
-- and ap:<tool>).
local function permit_value(name, v)
  if not v then
    if name == 'budget' or name == 'upol' or name == 'closed' or name == 'ten'
        or name == 'agents' or name == 'appr' then
      return nil
    end
    local prefix = string.sub(name, 1, 2)
    if prefix == 't:' or prefix == 'n:' or string.sub(name, 1, 3) == 'ap:' then
      return nil
    end
    return false
  end
  if string.sub(name, 1, 3) == 'ap:' then
    -- "<cost_at_least>:<wait>:<approvers>": {at (nil: every call), wait,
    -- approvers}.
    local at, wait, approvers = string.match(v, '^([0-9]*):([0-9]+):([12])$')
    wait = uint(wait)
    if not wait or wait < 1 or wait > MAX_DURATION or (at ~= '' and not uint(at)) then
      return false
    end
    return {at = uint(at), wait = wait, approvers = tonumber(approvers)}
  end
  if name == 'ten' or name == 'agents' or name == 'subject' or name == 'currency'
      or name == 'tools' then
    return v
  elseif name == 'status' then
    return (v == '1' and STATUS_ACTIVE) or (v == '2' and STATUS_REVOKED) or false
  elseif name == 'gmode' then
    return (v == '0' and GUARD_OFF) or (v == '1' and GUARD_LOG)
      or (v == '2' and GUARD_ENFORCE) or false
  elseif name == 'upol' or name == 'closed' or name == 'appr' then
    return v == '1'
  elseif v == '' and string.sub(name, 1, 2) == 't:' then
    return ''
  end
  local n = uint(v)
  if not n or ((name == 'lease' or name == 'gwin') and (n < 1 or n > MAX_DURATION)) then
    return false
  end
  return n
end

-- The permit fields `...` of the hash at `key` (HMGET), each read by
-- permit_value: p[name]. nil when there is no permit hash; p.unreadable
-- when a field is not what atmost writes, or one every permit has is
-- missing (exp among them: a hash without it is not a permit's).
local function read_permit(key, ...)
  local names = {...}
  local raw = redis.call('HMGET', key, ...)
  local p, any = {}, false
  for i, name in ipairs(names) do
    if raw[i] then
      any = true
    end
    local v = permit_value(name, raw[i])
    if v == false then
      p.unreadable = true
    else
      p[name] = v
    end
  end
  if not any and redis.call('EXISTS', key) == 0 then
    return nil
  end
  return p
end

-- The permit (keys[1]) as a caller of `tenant` (agent key id `agent`)
-- reads it at `now`: its fields exp, fa, open, ten, agents and `...`, or
-- nil and the answer: PERMIT_NOT_FOUND (none, forgotten, or not the
-- caller's to see: checked before readability, so another tenant learns
-- nothing of the record), or UNAVAILABLE (gone while its attempts,
-- keys[2], remain; unreadable).
local function permit_for(keys, now, tenant, agent, ...)
  local p = read_permit(keys[1], 'exp', 'fa', 'open', 'ten', 'agents', ...)
  if not p then
    return nil, permit_not_found(keys[2])
  end
  if not visible(p.ten, p.agents, tenant, agent) then
    return nil, NOT_VISIBLE
  end
  if p.unreadable then
    return nil, UNREADABLE_PERMIT
  end
  if forgotten(p, now) then
    return nil, PERMIT_NOT_FOUND
  end
  return p
end

-- Whether a whole permit hash (HGETALL's flat list) is what atmost
-- writes: each field by permit_value (the t:<tool>, n:<tool> and
-- ap:<tool> of any tool, an ap:<tool> only for a tool in scope of a permit
-- with appr; a field it does not know is left, as the service leaves it), none
-- that every permit has missing, and the text as the service decodes it
-- (store/redis/codec.rs: decode_permit): subject and currency UTF-8, tools
-- "\n"-joined tools each with its t:<tool>, ten a tenant, agents
-- "\n"-joined key ids. GetPermit and RevokePermit answer the hash, so
-- RevokePermit reads it whole before it writes.
local function readable_record(hash)
  -- Whether s is "\n"-joined names (none empty).
  local function joined(s, max, outside)
    for part in string.gmatch(s .. '\n', '([^\n]*)\n') do
      if not valid(part, max, outside) then
        return false
      end
    end
    return true
  end
  local f = {}
  for i = 1, #hash, 2 do
    f[hash[i]] = hash[i + 1]
  end
  for name in string.gmatch('subject currency tools exp lease gmode gwin status '
      .. 'created committed reserved open fa', '%S+') do
    if not f[name] then
      return false
    end
  end
  for name, v in pairs(f) do
    local prefix = string.sub(name, 1, 2)
    if (prefix == 't:' or prefix == 'n:' or string.find(' budget upol closed appr '
        .. 'exp lease gmode gwin status created committed reserved open fa ',
        ' ' .. name .. ' ', 1, true)) and permit_value(name, v) == false then
      return false
    end
    -- An approval rule: readable, for a tool in scope, on a permit that
    -- says it has one (appr).
    if string.sub(name, 1, 3) == 'ap:' and (not permit_value(name, v)
        or not f['t:' .. string.sub(name, 4)] or f.appr ~= '1') then
      return false
    end
  end
  if not (utf8_text(f.subject) and utf8_text(f.currency)
      and (not f.ten or valid(f.ten, 64, NAME))
      and (not f.agents or joined(f.agents, 64, NAME))
      and joined(f.tools, 128, TOOL)) then
    return false
  end
  for tool in string.gmatch(f.tools, '[^\n]+') do
    if not f['t:' .. tool] then
      return false
    end
  end
  return true
end

-- Open attempts pin the permit's keys; once none is open they expire
-- `retention` ms after the permit does, or after `now` if that is later (so
-- an attempt settled long after expiry is still kept for `retention`):
-- forget_at, which the script also records as `fa` in the permit hash, so
-- every script forgets the permit then on any clock (memory store:
-- Ledger::forget_at). Only the permit, attempts and dup keys (KEYS 1, 2,
-- 4) carry a TTL, and on a permit with approval rules (appr) the pending
-- and awaiting sets (KEYS 8, 9), which live as long as its attempts: the
-- open and held sets exist only while something is open, and are made
-- afresh, without one. (A pending call does not pin: its deadline is at
-- the latest the permit's expiry.)
local function pin(keys, appr)
  redis.call('PERSIST', keys[1])
  redis.call('PERSIST', keys[2])
  redis.call('PERSIST', keys[4])
  if appr then
    redis.call('PERSIST', keys[8])
    redis.call('PERSIST', keys[9])
  end
end

local function forget_at(exp, retention, now)
  return int(math.max(exp, now) + retention)
end

local function unpin(keys, at, appr)
  redis.call('PEXPIREAT', keys[1], at)
  redis.call('PEXPIREAT', keys[2], at)
  redis.call('PEXPIREAT', keys[4], at)
  if appr then
    redis.call('PEXPIREAT', keys[8], at)
    redis.call('PEXPIREAT', keys[9], at)
  end
end

-- === pending calls (approval rules) ===

local PENDING_SET_DISAGREES = {'ERR', 'STORE_UNAVAILABLE', 'pending set disagrees with the attempts'}
local AWAITING_SET_DISAGREES = {'ERR', 'STORE_UNAVAILABLE', 'awaiting set disagrees with the attempts'}
local APPROVALS_OF_ANOTHER_TYPE = {'ERR', 'STORE_UNAVAILABLE', 'approvals set of another type'}

-- Whether the pending and awaiting sets and the approvals index's shard
-- (keys[8], keys[9], keys[10]) are sorted sets or absent: checked before a
-- script's first write to any of them.
local function approvals_ready(keys)
  for i = 8, 10 do
    if type(redis.pcall('ZCARD', keys[i])) ~= 'number' then
      return false
    end
  end
  return true
end

-- The counters the pending calls `calls` ({key, a} each) hold, checked
-- before anything is written: calls.tools (tool -> the number of its slots
-- they hold), calls.n (tool -> the slots its n:<tool> counts after they
-- are returned), calls.reserved (the permit's reserved after their costs
-- are). nil and the answer when the permit's counters cannot hold them,
-- or (unless `reads_only`: get_permit.lua) the sets pending_write writes
-- are of another type.
local function pending_counts(keys, calls, reads_only)
  calls.tools, calls.n = {}, {}
  local cost, names = 0, {'reserved'}
  for _, c in ipairs(calls) do
    local tool = c.a.tool
    if not calls.tools[tool] then
      calls.tools[tool] = 0
      names[#names + 1] = 'n:' .. tool
    end
    calls.tools[tool] = calls.tools[tool] + 1
    cost = cost + c.a.cost
  end
  if #calls == 0 then
    return calls
  end
  local q = read_permit(keys[1], unpack(names))
  if not q or q.unreadable or not q.reserved then
    return nil, UNREADABLE_PERMIT
  end
  if not reads_only and not approvals_ready(keys) then
    return nil, APPROVALS_OF_ANOTHER_TYPE
  end
  for tool, held in pairs(calls.tools) do
    local n = q['n:' .. tool]
    if not n or n < held then
      return nil, {'ERR', 'STORE_UNAVAILABLE', 'permit counters disagree with its pending calls'}
    end
    calls.n[tool] = n - held
  end
  if q.reserved < cost then
    return nil, {'ERR', 'STORE_UNAVAILABLE', 'permit counters disagree with its pending calls'}
  end
  calls.reserved = q.reserved - cost
  return calls
end

-- The pending calls (keys[8]) whose deadline is before `upto` (a
-- ZRANGEBYLEX bound: "(" .. the member of `now + 1` for those past their
-- deadline at `now`, "+" for all), each checked against its record, with
-- their counters (pending_counts): {key, a} each, in (deadline, key)
-- order, and by_key. None on a permit without approval rules (p.appr
-- unset), where nothing is read. nil and the answer when a member names
-- no pending call in its place, or a record cannot be read.
local function pending_read(keys, p, upto, reads_only)
  local calls = {by_key = {}}
  if p.appr then
    for _, member in ipairs(redis.call('ZRANGEBYLEX', keys[8], '-', upto)) do
      local key = string.sub(member, 17)
      local a = key ~= '' and load_attempt(keys[2], key)
      if not a or not is_pending(a.state) or member ~= at15(a.lease) .. ':' .. key then
        return nil, PENDING_SET_DISAGREES
      end
      calls[#calls + 1] = {key = key, a = a}
      calls.by_key[key] = a
    end
  end
  return pending_counts(keys, calls, reads_only)
end

-- Writes the denial of the pending calls `calls` (checked by pending_read
-- or pending_counts): each one past its deadline at `now` lapses (denied
-- at its deadline, by nobody: domain, Ledger::lapse), any other is denied
-- as `deny` says ({reason, by, at}); its slot and cost come back, and it
-- leaves the pending set, and the awaiting set and the approvals index if
-- it was awaiting, and the duplicate guard's index (keys[4]) as a release
-- does. Each `a` of `calls` is changed to what is written, and
-- p's counters (reserved, n:<tool>, where p has them) to theirs.
local function pending_write(keys, p, calls, now, deny)
  if #calls == 0 then
    return
  end
  for _, c in ipairs(calls) do
    local a, key = c.a, c.key
    local was, ap = a.state, a.ap
    if a.lease <= now then
      ap.reason, ap.by, ap.at = lapse_reason(was), '', a.lease
    else
      ap.reason, ap.by, ap.at = deny.reason, deny.by, deny.at
    end
    a.state = DENIED
    save_attempt(keys[2], key, a)
    -- Never sent: it leaves the duplicate guard's index as a released
    -- call does, the earlier key it repeated taking its place
    -- (Ledger::dup_forget).
    local dup_key = dup_field(a.tool, a.fp)
    if redis.call('HGET', keys[4], dup_key) == key then
      if a.dup_of ~= '' then
        redis.call('HSET', keys[4], dup_key, a.dup_of)
      else
        redis.call('HDEL', keys[4], dup_key)
      end
    end
    redis.call('ZREM', keys[8], at15(a.lease) .. ':' .. key)
    if was == AWAITING then
      redis.call('ZREM', keys[9], at15(a.created) .. ':' .. key)
      redis.call('ZREM', keys[10], index_member(keys, a.created, key))
    end
  end
  local fields = {'reserved', int(calls.reserved)}
  p.reserved = p.reserved and calls.reserved
  for tool, n in pairs(calls.n) do
    fields[#fields + 1] = 'n:' .. tool
    fields[#fields + 1] = int(n)
    if p['n:' .. tool] then
      p['n:' .. tool] = n
    end
  end
  redis.call('HSET', keys[1], unpack(fields))
end

-- Writes every lapse due at `now` (Ledger::lapse), as every transition
-- does first: nil, or the answer when the pending set cannot be read
-- (nothing is written then). The calls lapsed are returned, by key.
local function lapse(keys, p, now)
  local calls, refused = pending_read(keys, p, '(' .. at15(now + 1))
  if not calls then
    return nil, refused
  end
  pending_write(keys, p, calls, now)
  return calls.by_key
end
