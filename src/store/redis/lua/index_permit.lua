#!lua
-- index_permit.lua: puts a new permit (its hash already written) in its
-- tenant's index, unless the tenant has as many unexpired permits as its
-- quota allows: the count and the add are one step.
--
-- KEYS[1]  <prefix>:permits[:<tenant>]  (lex: "<expires_at, 15 digits>:<id>")
-- KEYS[2]  <prefix>:{P}:permit, deleted when refused (nobody knows its id)
-- ARGV[1]  now (ms; "" = Redis's clock)  ARGV[2]  the quota (0 = none)
-- ARGV[3]  the permit's member
--
-- Returns {"OK"}, or {"ERR", "QUOTA_TENANT_PERMITS", limit}.
-- Example: ARGV={"", "100000", "001767225600000:0190..."} -> {"OK"}

local now = clock(ARGV[1])
local limit = tonumber(ARGV[2])
if limit > 0
    and redis.call('ZLEXCOUNT', KEYS[1], '[' .. at15(now + 1), '+') >= limit then
  redis.call('DEL', KEYS[2])
  return {'ERR', 'QUOTA_TENANT_PERMITS', ARGV[2]}
end
redis.call('ZADD', KEYS[1], 0, ARGV[3])
return {'OK'}
