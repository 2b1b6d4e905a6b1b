#!lua flags=no-writes
-- list_index.lua: one shard of a tenant's uncertain index (lib.lua): the
-- members of attempts UNCERTAIN at `now` (including RESERVED ones past
-- their lease) after a cursor, in (uncertain since, permit id, key) order:
-- one range read, so it costs what it returns however many permits or
-- open attempts the tenant has. The same for a shard of a tenant's
-- approvals index: the members of calls awaiting approval (or lapsed,
-- their lapse not yet written) requested up to `now`, in (created,
-- permit id, key) order.
--
-- KEYS[1]  <prefix>:uncertain:{T}:t:<tenant>  (or
--          <prefix>:approvals:{T}:t:<tenant>)
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  list after this member ("<at>:<permit id>:<key>"; "" = from the
--          start)
-- ARGV[3]  at most this many (at least 1)
--
-- Returns {"OK", member, member, ...}. The attempts are read afterwards,
-- permit by permit (uncertain_attempts.lua, awaiting_attempts.lua), each
-- where it lives.
-- Example: ARGV={"","",100} -> {"OK", "001767225590000:<uuid>:order-42"}

local now = clock(ARGV[1])
local from = '-'
if ARGV[2] ~= '' then
  from = '(' .. ARGV[2]
end
-- Members up to "<now + 1>" (exclusive) are those uncertain at `now`.
local out = redis.call('ZRANGEBYLEX', KEYS[1], from, '(' .. at15(now + 1),
  'LIMIT', 0, tonumber(ARGV[3]))
table.insert(out, 1, 'OK')
return out
