#!lua
-- index_tenant.lua: puts a tenant in the tenants index, with a fresh
-- token: run for each new permit after index_permit.lua has indexed it, so
-- the sweep and the census find the tenant's index. Its entry replaces the
-- tenant's earlier one, so a sweep that saw the index empty and then
-- removes the entry it read (ZREM of that exact member) removes nothing
-- once a permit was indexed since (store/redis.rs: Store::sweep).
--
-- KEYS[1]  <prefix>:tenants  (ZSET, all scores 0, by lex:
--          "<tenant>\n<token>", one member per tenant)
-- ARGV[1]  the tenant (1..=64 of [A-Za-z0-9._-])
-- ARGV[2]  the token: the new permit's id
--
-- Returns {"OK"}, or {"ERR", "STORE_UNAVAILABLE", why} for a tenant or a
-- token that cannot be an entry (only a bug could pass one).
-- Example: ARGV={"acme", "0190a6e0-..."} -> {"OK"}  (the index now holds
--   "acme\n0190a6e0-..." and no other member for acme)

local tenant, token = ARGV[1], ARGV[2]
if #tenant > 64 or not string.find(tenant, '^[%w._-]+$') then
  return {'ERR', 'STORE_UNAVAILABLE', 'tenant ' .. string.format('%q', tenant)
    .. ' cannot be a tenants index entry'}
end
if token == '' or string.find(token, '\n', 1, true) then
  return {'ERR', 'STORE_UNAVAILABLE', 'token ' .. string.format('%q', token)
    .. ' cannot be a tenants index entry'}
end
-- The tenant's members sort in ["<tenant>\n", "<tenant>\v"): its name's
-- characters all sort after "\v", so no other tenant's member is in range.
local earlier = redis.call('ZRANGEBYLEX', KEYS[1], '[' .. tenant .. '\n',
  '(' .. tenant .. '\v')
for _, member in ipairs(earlier) do
  redis.call('ZREM', KEYS[1], member)
end
redis.call('ZADD', KEYS[1], 0, tenant .. '\n' .. token)
return {'OK'}
