#!lua flags=no-writes
-- census.lua: how many attempts of one shard of the uncertain index
-- (lib.lua) are UNCERTAIN at `now` (including RESERVED ones past their
-- lease), and since when the oldest has been, for the uncertain census
-- (src/telemetry/census.rs). Two range reads: O(log n) however many
-- attempts are open.
--
-- KEYS[1]  <prefix>:uncertain:{T}
-- ARGV[1]  now (ms; "" = Redis's clock)
--
-- Returns {"OK", now, uncertain, oldest_since} (oldest_since 0 when none
-- is uncertain), or {"ERR", "STORE_UNAVAILABLE", why} when the first
-- member is not "<at>:<permit id>:<key>": never counted as 0 (the pass
-- fails, and its census age tells).
-- Example: ARGV={""} -> {"OK", "1767225600000", 2, "1767225590000"}

local now = clock(ARGV[1])
-- Members up to "<now + 1>" (exclusive) are those uncertain at `now`.
local upto = '(' .. at15(now + 1)
local n = redis.call('ZLEXCOUNT', KEYS[1], '-', upto)
if n == 0 then
  return {'OK', int(now), 0, '0'}
end
local first = redis.call('ZRANGEBYLEX', KEYS[1], '-', upto, 'LIMIT', 0, 1)[1]
if not string.find(first, '^' .. string.rep('[0-9]', 15) .. ':.') then
  return {'ERR', 'STORE_UNAVAILABLE', 'uncertain index member is not "<at>:<permit>:<key>"'}
end
return {'OK', int(now), n, string.sub(first, 1, 15)}
