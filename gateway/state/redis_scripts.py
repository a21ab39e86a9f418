"""Redis-backed state store: many gateway replicas share one registry and one set of reservations.

Keys (prefix `fg:` by default; docs/design.md "Shared state"):
  fg:workers            hash  worker id -> JSON WorkerRecord
  fg:metrics            hash  worker id -> JSON EngineMetrics
  fg:res:<worker>       zset  "<replica>|<request_id>" (or a leased slot, "<replica>|<n>~") scored by lease
                              expiry (ms, Redis TIME)
  fg:resworkers         set   workers that may have reservations (so the refresh needs no SCAN)
  fg:load:<replica>     hash  "r:<worker>" -> requests, "t:<worker>" -> tokens this replica holds;
                              PEXPIRE'd with the lease and rewritten from local truth by each heartbeat (and,
                              with leases, by each refresh)
  fg:waiters            set   replicas with requests waiting in their admission queues
  fg:replicas           zset  replica id scored by lease expiry (ms)
  fg:docs               hash  document key -> JSON (fitted models, predictor state, admin-made API keys)
  fg:alive              str   this store's epoch: a random id written once; gone means Redis lost its data
  fg:kb:<tenant>        hash  a limited key's buckets: r, rt (requests, ms), t, tt (tokens, ms)
  fg:kc:<tenant>        zset  the key's requests in flight, "<replica>|<request_id>" scored like res:<worker>
  fg:resp:<tenant>:<id> str   a stored Responses-API response and its conversation (gateway/state/responses.py)

Admission is one Lua script (DESIGN principle 3): drop expired members, compare ZCARD with the cap,
ZADD. Each replica re-scores its own members every lease_ttl/3, so a SIGKILLed replica's reservations
expire after the TTL while a live one's never do. Token counts live in the per-replica load hash
(the zset counts requests; tokens of dead replicas vanish when their hash's TTL runs out).

Leases (`lease_block` > 1, the gateway's default: config `redis_lease_block`): a reservation that finds no
free slot of this replica's on the worker takes up to `lease_block` slots in one script (as many as the cap
leaves, and only one while another replica has requests waiting), one for the request and the rest kept
free here; later reservations take a free slot with no Redis call, and a release puts its slot back among the
free ones, also with no call. Leased slots are zset members like reservations, so the cap counts them, the
heartbeat re-scores them (a dead replica's lease expires after the TTL) and writes them back into a Redis that
restarted empty. Free slots go back to Redis (one script, which announces the release to waiting replicas) when
they have gone unused for `lease_idle_s`, beyond one spare block, at once while another replica has requests
waiting (seen by the refresh, so within `refresh_interval_s`), and on close. Other replicas' in-flight requests
are then read from their load hashes, which each refresh rewrites from this replica's counts.

`inflight()` is a cache: every `refresh_interval_s` one script returns, atomically, each worker's
ZCARD, other replicas' tokens and this replica's own counts; the cache is
(total - own at that instant) + own now, so this replica's reserve/release show up at once and a
refresh racing a reserve never double-counts or loses it.

Per-key limits (gateway/state/ratelimit.py) ride on the reservation: a request with an open ticket reserves with
a second script that also checks and takes from its key's buckets and concurrency set, in the same call;
settlements of finished requests go with this replica's next script call (reservation or refresh).

Losing Redis after start fails open (DESIGN principle 6): reservations fall back to local accounting
against the last cached view and key limits to this replica's own buckets; one line is logged when Redis
goes, a reminder every 30 s while it stays away, one when it is back; when Redis answers again the next
heartbeat re-adds the reservations made meanwhile. A Redis that comes back empty (restarted without
persistence, flushed) is told by its epoch key: reads then serve the last known state instead of the empty
one, the gateway's parts write back what they hold (`on_restore`: workers, API keys), the heartbeat
re-adds this replica's reservations and key concurrency, and a new epoch is written. The scripts build key names from the prefix inside Lua, so
this targets a standalone Redis (or one shard), not Redis Cluster.
"""

from __future__ import annotations

import asyncio

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Errors that make us fail open: Redis unreachable, slow, or refusing writes (OOM, READONLY replica).
_DOWN_ERRORS = (RedisError, RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)

_NOW_MS = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Taking the slot, once the checks passed (KEYS and ARGV as for _RESERVE; `now` and `ttl` set).
_TAKE_SLOT = """
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('HINCRBY', KEYS[2], 'r:' .. ARGV[4], 1)
redis.call('HINCRBY', KEYS[2], 't:' .. ARGV[4], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('SADD', KEYS[3], ARGV[4])
redis.call('ZADD', KEYS[4], 'GT', now + ttl, ARGV[6])
"""

# KEYS: res:<worker>, load:<replica>, resworkers, replicas
# ARGV: member, cap (-1 = none), ttl_ms, worker, tokens, replica
_RESERVE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local cap = tonumber(ARGV[2])
if cap >= 0 and redis.call('ZCARD', KEYS[1]) >= cap then return 0 end
local ttl = tonumber(ARGV[3])
""" + _TAKE_SLOT + """return 1
"""

# KEYS: res:<worker>, resworkers, replicas, waiters, load:<replica>
# ARGV: replica, cap (-1 = none), ttl_ms, worker, block, first sequence number, then this replica's requests and
# tokens on the worker with the new one (its load hash, so other replicas see them before the next refresh).
# Returns the slots leased (0: full).
_LEASE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local want = tonumber(ARGV[5])
if redis.call('SCARD', KEYS[4]) > redis.call('SISMEMBER', KEYS[4], ARGV[1]) then want = 1 end
local cap = tonumber(ARGV[2])
if cap >= 0 then
  local free = cap - redis.call('ZCARD', KEYS[1])
  if free < want then want = free end
end
if want <= 0 then return 0 end
local ttl, seq = tonumber(ARGV[3]), tonumber(ARGV[6])
for j = 0, want - 1 do redis.call('ZADD', KEYS[1], now + ttl, ARGV[1] .. '|' .. string.format('%d', seq + j) .. '~') end
redis.call('SADD', KEYS[2], ARGV[4])
redis.call('ZADD', KEYS[3], 'GT', now + ttl, ARGV[1])
redis.call('HSET', KEYS[5], 'r:' .. ARGV[4], ARGV[7], 't:' .. ARGV[4], ARGV[8])
redis.call('PEXPIRE', KEYS[5], ttl)
return want
"""

# Give leased slots back. KEYS: res:<worker>, waiters, load:<replica>; ARGV: channel, "replica|worker", worker,
# this replica's requests and tokens on it now (its load hash, read by a woken replica's refresh), ttl_ms, then the
# members.
_RETURN = """
local n = redis.call('ZREM', KEYS[1], unpack(ARGV, 7))
if tonumber(ARGV[4]) > 0 then
  redis.call('HSET', KEYS[3], 'r:' .. ARGV[3], ARGV[4], 't:' .. ARGV[3], ARGV[5])
  redis.call('PEXPIRE', KEYS[3], ARGV[6])
else
  redis.call('HDEL', KEYS[3], 'r:' .. ARGV[3], 't:' .. ARGV[3])
end
if redis.call('SCARD', KEYS[2]) > 0 then redis.call('PUBLISH', ARGV[1], ARGV[2]) end
return n
"""

# Settle finished requests' token reservations: ARGV[i] = n, then n x (tenant, tpm, tokens to give back).
_SETTLE = """
local function settle_all(P, now, i)
  local n = tonumber(ARGV[i])
  i = i + 1
  for _ = 1, n do
    local key, tpm, delta = P .. 'kb:' .. ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    local h = redis.call('HMGET', key, 't', 'tt')
    if h[1] then
      local t = math.min(tpm, tonumber(h[1]) + math.max(0, now - tonumber(h[2])) * tpm / 60000)
      redis.call('HSET', key, 't', math.min(tpm, t + delta), 'tt', now)
    end
    i = i + 3
  end
  return i
end
"""

# The reservation of a request whose key has limits: the cap check of _RESERVE, then the key's concurrency and
# buckets (charged once per request: ARGV[7] == '1'), all or nothing.
# KEYS: res:<worker>, load:<replica>, resworkers, replicas, kb:<tenant>, kc:<tenant>
# ARGV: member, cap, ttl_ms, worker, tokens, replica, charge, rpm, tpm, max_concurrency (-1 = none), cost,
#       prefix, then the settlements
# Returns {status, wait_ms, requests left, tokens left}; status 1 reserved, 0 worker full, -1 out of requests,
# -2 out of tokens, -3 at max concurrency, -4 the request needs more tokens than a minute's limit.
_KEYED_RESERVE = _NOW_MS + _SETTLE + """
settle_all(ARGV[12], now, 13)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local cap = tonumber(ARGV[2])
if cap >= 0 and redis.call('ZCARD', KEYS[1]) >= cap then return {0, 0, '-1', '-1'} end
local ttl, maxcon = tonumber(ARGV[3]), tonumber(ARGV[10])
local rl, tl = -1, -1
if ARGV[7] == '1' then
  local rpm, tpm, cost = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[11])
  local h = redis.call('HMGET', KEYS[5], 'r', 'rt', 't', 'tt')
  if rpm >= 0 then
    rl = rpm
    if h[1] then rl = math.min(rpm, tonumber(h[1]) + math.max(0, now - tonumber(h[2])) * rpm / 60000) end
  end
  if tpm >= 0 then
    tl = tpm
    if h[3] then tl = math.min(tpm, tonumber(h[3]) + math.max(0, now - tonumber(h[4])) * tpm / 60000) end
  end
  if maxcon >= 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
    if redis.call('ZCARD', KEYS[6]) >= maxcon then return {-3, 1000, tostring(rl), tostring(tl)} end
  end
  if tpm >= 0 and cost > tpm then return {-4, 0, tostring(rl), tostring(tl)} end
  local wait, why = 0, 0
  if rpm >= 0 and rl < 1 then wait = (1 - rl) * 60000 / rpm; why = -1 end
  if tpm >= 0 and tl < cost and (cost - tl) * 60000 / tpm > wait then wait = (cost - tl) * 60000 / tpm; why = -2 end
  if why ~= 0 then return {why, math.ceil(wait), tostring(rl), tostring(tl)} end
  if rpm >= 0 then rl = rl - 1; redis.call('HSET', KEYS[5], 'r', rl, 'rt', now) end
  if tpm >= 0 then tl = tl - cost; redis.call('HSET', KEYS[5], 't', tl, 'tt', now) end
  redis.call('PEXPIRE', KEYS[5], 180000)
end
if maxcon >= 0 then
  redis.call('ZADD', KEYS[6], now + ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[6], ttl * 2)
end
""" + _TAKE_SLOT + """return {1, 0, tostring(rl), tostring(tl)}
"""

# KEYS: res:<worker>, load:<replica>, waiters[, kc:<tenant> when the request's last reservation ends]
# ARGV: member, worker, tokens, channel, replica
# Counts drop only if the member was there, so replaying a release that raced a heartbeat is safe. While any
# replica has requests waiting (the `waiters` set), the release is announced on the channel ("replica|worker"):
# their admission queues retry at once instead of at their next poll.
_RELEASE = """
if KEYS[4] then redis.call('ZREM', KEYS[4], ARGV[1]) end
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 and redis.call('EXISTS', KEYS[2]) == 1 then
  local r = redis.call('HINCRBY', KEYS[2], 'r:' .. ARGV[2], -1)
  redis.call('HINCRBY', KEYS[2], 't:' .. ARGV[2], -tonumber(ARGV[3]))
  if r <= 0 then redis.call('HDEL', KEYS[2], 'r:' .. ARGV[2], 't:' .. ARGV[2]) end
end
if redis.call('SCARD', KEYS[3]) > 0 then redis.call('PUBLISH', ARGV[4], ARGV[5] .. '|' .. ARGV[2]) end
return 1
"""

# KEYS: replicas, load:<replica>, resworkers
# ARGV: prefix, replica, ttl_ms, n, then n x (worker, member), m, then m x (tenant, member) for key concurrency,
# then (field, value) pairs for the load hash
_HEARTBEAT = _NOW_MS + """
local P, ttl = ARGV[1], tonumber(ARGV[3])
local exp = now + ttl
redis.call('ZADD', KEYS[1], exp, ARGV[2])
local n = tonumber(ARGV[4])
local i = 5
for _ = 1, n do
  redis.call('ZADD', P .. 'res:' .. ARGV[i], exp, ARGV[i + 1])
  redis.call('SADD', KEYS[3], ARGV[i])
  i = i + 2
end
local m = tonumber(ARGV[i])
i = i + 1
for _ = 1, m do
  redis.call('ZADD', P .. 'kc:' .. ARGV[i], exp, ARGV[i + 1])
  redis.call('PEXPIRE', P .. 'kc:' .. ARGV[i], ttl * 2)
  i = i + 2
end
redis.call('DEL', KEYS[2])
while i < #ARGV do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  i = i + 2
end
if n > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return n
"""

# ARGV: prefix, replica, then settlements, then ttl_ms, m (-1: leave this replica's load hash alone), then m x
# (field, value) to write it with. Returns the epoch (false: none), how many other replicas have requests waiting,
# then flat [worker, zcard, other replicas' tokens, own requests, other replicas' requests] per worker.
_REFRESH = _NOW_MS + _SETTLE + """
local P, me = ARGV[1], ARGV[2]
local i = settle_all(P, now, 3)
local ttl, m = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
i = i + 2
if m >= 0 then
  local lk = P .. 'load:' .. me
  redis.call('DEL', lk)
  for _ = 1, m do
    redis.call('HSET', lk, ARGV[i], ARGV[i + 1])
    i = i + 2
  end
  if m > 0 then redis.call('PEXPIRE', lk, ttl) end
end
redis.call('ZREMRANGEBYSCORE', P .. 'replicas', '-inf', now)
local tok, req = {}, {}
for _, rep in ipairs(redis.call('ZRANGE', P .. 'replicas', 0, -1)) do
  if rep ~= me then
    local h = redis.call('HGETALL', P .. 'load:' .. rep)
    for j = 1, #h, 2 do
      local kind, w = string.sub(h[j], 1, 2), string.sub(h[j], 3)
      if kind == 't:' then
        tok[w] = (tok[w] or 0) + tonumber(h[j + 1])
      elseif kind == 'r:' then
        req[w] = (req[w] or 0) + tonumber(h[j + 1])
      end
    end
  end
end
local own = {}
local h = redis.call('HGETALL', P .. 'load:' .. me)
for j = 1, #h, 2 do
  if string.sub(h[j], 1, 2) == 'r:' then own[string.sub(h[j], 3)] = tonumber(h[j + 1]) end
end
local out = {redis.call('GET', P .. 'alive'),
             redis.call('SCARD', P .. 'waiters') - redis.call('SISMEMBER', P .. 'waiters', me)}
for _, w in ipairs(redis.call('SMEMBERS', P .. 'resworkers')) do
  local key = P .. 'res:' .. w
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local c = redis.call('ZCARD', key)
  if c == 0 then redis.call('SREM', P .. 'resworkers', w) end
  out[#out + 1] = w
  out[#out + 1] = c
  out[#out + 1] = tok[w] or 0
  out[#out + 1] = own[w] or 0
  out[#out + 1] = req[w] or 0
end
return out
"""


# KEYS: docs, alive; ARGV: glob. The epoch, then the matching (key, value) pairs, read in one step.
_GET_DOCS = """
local out = {redis.call('GET', KEYS[2])}
local cur = '0'
repeat
  local r = redis.call('HSCAN', KEYS[1], cur, 'MATCH', ARGV[1], 'COUNT', 500)
  cur = r[1]
  for _, v in ipairs(r[2]) do out[#out + 1] = v end
until cur == '0'
return out
"""
