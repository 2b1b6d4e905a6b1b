#!lua
-- index_permit.lua: puts a new permit (its hash already written) in its
-- tenant's index, unless the tenant has as many unexpired permits as its
-- quota allows: the count and the add are one step, on one key. A refused
-- permit's hash is deleted by the caller.
--
-- KEYS[1]  <prefix>:permits[:<tenant>]  (lex: "<expires_at, 15 digits>:<id>")
-- ARGV[1]  now (ms; "" = Redis's clock)  ARGV[2]  the quota (0 = none)
-- ARGV[3]  the permit's member
--
-- Returns {"OK"}, or {"ERR", "QUOTA_TENANT_PERMITS", limit}. Run again
-- for a member already indexed, it answers OK: the member is not counted
-- against itself.
-- Example: ARGV={"", "100000", "001767225600000:0190..."} -> {"OK"}

local now = clock(ARGV[1])
local limit = tonumber(ARGV[2])
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  return {'OK'}
end
if limit > 0
    and redis.call('ZLEXCOUNT', KEYS[1], '[' .. at15(now + 1), '+') >= limit then
  return {'ERR', 'QUOTA_TENANT_PERMITS', ARGV[2]}
end
redis.call('ZADD', KEYS[1], 0, ARGV[3])
return {'OK'}
