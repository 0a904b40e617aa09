-- lease.lua: a producer leases its next shard, idempotently. A run of one group (meta
-- 'groups' unset) takes the fast path: the rank furthest behind with room mints. In a run
-- of several, a shard is minted once for the groups of a family at its cursor, paced by
-- their windows and max_lag (docs/design.md "Data-parallel trainers", "Several groups").
-- Returns {'OK', g, skip, slots, world, mask, stamp, attempts[, shard]}, {'WAIT', slot},
--   {'BUSY'} (prefetch declined), {'GROUPS', n}, {'STATE_LOST'}, {'RUN_CHANGED'},
--   {'FINISHED'}, {'REAPED'} (join again): LeaseReply (producer_scripts.py) says what each is
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local work_key = KEYS[3]         -- LIST   shards handed back ('<g>' or '<g>/<mask>')
local lease_key = KEYS[4]        -- LIST   this producer's leases
local producers_key = KEYS[5]    -- ZSET   producer -> heartbeat deadline (ms)
local failures_key = KEYS[6]     -- HASH   g -> failed attempts (handback.lua, reaps)
-- KEYS[7..]: every group slot's ledger (one in a run of one group), then every slot's
-- data lists (of its own world), then each slot's remap hash (in a run of one group only
-- where data-parallel)
local incarnation = ARGV[1]
local run = ARGV[2]
local producer = ARGV[3]
local token = ARGV[4]            -- per lease request: a retry with it gets the same shard
local heartbeat_ttl_ms = tonumber(ARGV[5])
local prefetch = tonumber(ARGV[6])  -- k > 0 behind a shard's last push
local after = ARGV[7]            -- the lease entry of the push this rides behind
local groups = tonumber(ARGV[8])  -- the group slots the caller's KEYS are for (0: one group)
local first_ledger = 7

local now = server_now_ms()
if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local m = redis.call('HMGET', meta_key, 'run', 'finished', 'window', 'shards', 'world', 'even',
  'hwm', 'groups', 'epoch_batches', 'params', 'remap_epoch', 'next', 'floor', 'mixed_worlds')
local n = tonumber(m[8] or '0')
local refused = run_refused(m, run) or (n ~= groups and {'GROUPS', n}) or
  heartbeat(producers_key, producer, now + heartbeat_ttl_ms)
if refused then return refused end

local world = tonumber(m[5] or '1')
local shards = tonumber(m[4])
-- The slots of an epoch for w ranks (batchq/protocol/ranks.py slots_for).
local function slots_for(w, even)
  if w == 1 then return shards end
  if even == 'drop' then return w * math.floor(shards / w) end
  return w * math.ceil(shards / w)
end
-- Each group slot reads with its own ranks (meta 'world', 'even'; slot i's '<name>@<i>'),
-- fixed while the run has the slot: its lists in KEYS and its global slot numbers are its
-- world's (ws, Ss); its elastic resume's remap is its own (rs, re: remap_epoch[@<i>]).
local S = slots_for(world, m[6])
local ws, Ss, data_at, at = {[0] = world}, {[0] = S}, {[0] = first_ledger + math.max(n, 1)}, nil
local rs, re = {}, {[0] = tonumber(m[11] or '')}
at = data_at[0] + world
for i = 1, n - 1 do
  local f = {m[5], m[6]}  -- slot 0's, unless some slot differs (meta mixed_worlds)
  if m[14] then f = redis.call('HMGET', meta_key, 'world@' .. i, 'even@' .. i, 'remap_epoch@' .. i) end
  ws[i], data_at[i], re[i] = tonumber(f[1] or '1'), at, tonumber(f[3] or '')
  Ss[i], at = slots_for(ws[i], f[2]), at + ws[i]
end
for i = 0, (n == 0 and world > 1) and 0 or n - 1 do rs[i] = KEYS[at + i] end
if #KEYS ~= at - 1 + (n > 0 and n or (world > 1 and 1 or 0)) then
  if n == 0 then return {'RUN_CHANGED'} end  -- a stale view of the run's world
  return {'GROUPS', n}
end
local P = S / world
local stamp = m[10] or ''  -- the params log's version rides with every lease
local W, hwm = tonumber(m[3]), tonumber(m[7])
local suffix = ':' .. run .. ':' .. token  -- the lease entry's tail (layout.py)

local function has_room(i, r) return redis.call('LLEN', KEYS[data_at[i] + r]) < hwm end
-- The ledger of slot i names slots as '<epoch>:<slot>': 'd' when done, else batches had.
local function had(i, g)
  local v = redis.call('HGET', KEYS[first_ledger + i], math.floor(g / Ss[i]) .. ':' .. (g % Ss[i]))
  if v == 'd' then return -1 end
  return tonumber(v or '0')
end
local function reading(i, r)
  return redis.call('HGET', meta_key, 'done' .. reader_sfx(i, r, ws[i])) ~= '1'
end
local function first_of(mask)  -- the lowest slot of a mask (its world and S: all slots')
  local i = 0
  while i < 31 and not mask_has(mask, i) do i = i + 1 end
  return i
end
-- The groups of `mask` still reading rank r that need g: (their mask, the batches the
-- one that has fewest already has); mask 0 when none does. A run of one group: slot 0
-- needs what its ledger does not mark done.
local function needed(g, mask, r)
  if n == 0 then return 1, math.max(had(0, g), 0) end
  local out, skip = 0, nil
  for i = 0, n - 1 do
    if mask_has(mask, i) and reading(i, r) then
      local h = had(i, g)
      if h >= 0 then
        out = out + 2 ^ i
        if skip == nil or h < skip then skip = h end
      end
    end
  end
  return out, skip or 0
end
local function rank_of(g, mask) local i = first_of(mask); return (g % Ss[i]) % ws[i] end
local function granted(g, mask, skip)
  g = tonumber(g)
  local i = first_of(mask)
  local out = {'OK', tostring(g), skip, Ss[i], ws[i], mask, stamp,
    tonumber(redis.call('HGET', failures_key, tostring(g)) or '0')}
  if n == 0 and world == 1 then out[4] = 0 end
  -- A slot of a remapped epoch names the shard it builds (a resume with other ranks).
  if rs[i] and re[i] and math.floor(g / Ss[i]) == re[i] then
    local shard = redis.call('HGET', rs[i], tostring(g % Ss[i]))
    if shard then out[9] = shard end
  end
  return out
end
local function grant(g, mask, skip)
  redis.call('RPUSH', lease_key, work_spec(g, mask) .. suffix)
  return granted(g, mask, skip)
end

-- A retried request first (its first reply was lost): the same shard, even if the
-- producer now holds k leases with it.
for _, e in ipairs(redis.call('LRANGE', lease_key, 0, -1)) do
  if string.sub(e, -#suffix) == suffix then
    local g, mask = parse_spec(e)
    local _, skip = needed(g, mask, rank_of(g, mask))
    return granted(g, mask, skip)
  end
end
-- A prefetch (k = prefetch > 0, sent right behind a shard's last push) is declined when
-- that push did not go through (its entry `after` is still leased) or k leases are held.
if prefetch > 0 and (redis.call('LPOS', lease_key, after) or
    redis.call('LLEN', lease_key) >= prefetch) then
  return {'BUSY'}
end

if n == 0 then
  -- The fast path: one group, each rank's cursor 'next[:<rank>]' (world 1: meta's).
  local function room(r) return has_room(0, r) and reading(0, r) end
  local g
  if world == 1 then
    g = redis.call('LPOP', work_key)
  else
    for _, e in ipairs(redis.call('LRANGE', work_key, 0, 99)) do
      if room((tonumber(e) % S) % world) then
        redis.call('LREM', work_key, 1, e)
        g = e
        break
      end
    end
  end
  if g then return grant(g, 1, math.max(had(0, tonumber(g)), 0)) end
  local best, nxt, floor = 0, tonumber(m[12]), tonumber(m[13])
  if world > 1 then
    best = nil
    for r = 0, world - 1 do
      local sfx = reader_sfx(0, r, world)
      local f = redis.call('HMGET', meta_key, 'next' .. sfx, 'floor' .. sfx)
      local v, fl = tonumber(f[1] or '0'), tonumber(f[2] or '0')
      if v < fl + W and room(r) and (best == nil or v - fl < nxt - floor) then
        best, nxt, floor = r, v, fl
      end
    end
    if best == nil then return {'WAIT'} end
  end
  -- Slots the rank has all of (a resumed ledger) are passed, never built.
  local field = 'next' .. reader_sfx(0, best, world)
  while nxt < floor + W do
    local g = math.floor(nxt / P) * S + (nxt % P) * world + best
    local skip = had(0, g)
    nxt = nxt + 1
    if skip >= 0 then
      redis.call('HSET', meta_key, field, nxt)
      return grant(g, 1, skip)
    end
  end
  redis.call('HSET', meta_key, field, nxt)
  return {'WAIT'}
end

local per_shard = 1
local eb = tonumber(m[9] or '-1')
if eb > 0 and shards > 0 then per_shard = eb / shards end

-- A shard handed back, for the groups it names, once one of their lists has room and
-- none that paces (no max_lag) is full (design.md "Several groups": why).
for _, e in ipairs(redis.call('LRANGE', work_key, 0, 99)) do
  local g, mask = parse_spec(e)
  if g then
    local r = rank_of(g, mask)
    local want, skip = needed(g, mask, r)
    if want == 0 then
      redis.call('LREM', work_key, 1, e)  -- every group it was for has it, or finished
    else
      local room, held = false, false
      for i = 0, n - 1 do
        if mask_has(want, i) then
          if has_room(i, r) then room = true
          elseif not redis.call('HGET', meta_key, 'max_lag' .. reader_sfx(i, 0, 1)) then
            held = true
          end
        end
      end
      if room and not held then
        redis.call('LREM', work_key, 1, e)
        return grant(g, want, skip)
      end
    end
  end
end
-- The families: the group slots of one numbering (world and S). Only they share a shard
-- (slot g of one world is another slice of the plan in another), and pace each other.
local fams, by_key = {}, {}
for i = 0, n - 1 do
  local key = ws[i] .. ':' .. Ss[i]
  local fam = by_key[key] or {w = ws[i], S = Ss[i], slots = {}}
  if not by_key[key] then by_key[key], fams[#fams + 1] = fam, fam end
  table.insert(fam.slots, i)
end
-- A group in the epoch its elastic resume remapped shares none of it: its slot, else -1.
local function own(c, v, fam)
  if c.remap and c.remap == math.floor(v * fam.w / fam.S) then return c.slot end
  return -1
end
-- Each rank's readers in a family: every group still reading it, its cursor, floor and
-- list room, and whether it may be left behind (max_lag set and exceeded); and the
-- furthest cursor.
local function readers(fam, r)
  local out, lead, front = {}, nil, nil
  for _, i in ipairs(fam.slots) do
    local sfx = reader_sfx(i, r, fam.w)
    local f = redis.call('HMGET', meta_key, 'next' .. sfx, 'floor' .. sfx, 'done' .. sfx,
      'max_lag' .. reader_sfx(i, 0, 1))
    if f[3] ~= '1' then
      local c = {slot = i, next = tonumber(f[1] or '0'), floor = tonumber(f[2] or '0'),
        max_lag = tonumber(f[4] or ''), room = has_room(i, r), remap = re[i]}
      if c.floor > c.next then
        -- The group has every shard below its floor (frames listed before its trainer
        -- restarted at an earlier cursor): never mint those again.
        c.next = c.floor
        redis.call('HSET', meta_key, 'next' .. sfx, c.next)
      end
      out[#out + 1] = c
      if lead == nil or c.floor > lead then lead = c.floor end
      if front == nil or c.next > front then front = c.next end
    end
  end
  for _, c in ipairs(out) do
    c.detachable = c.max_lag ~= nil and (lead - c.floor) * per_shard > c.max_lag
  end
  return out, front
end

-- The stream to mint from: for each family's rank, each cursor value held by a group; the
-- largest (the shared stream) only within the window of every group that paces it. A
-- group joins a stream within its own window, with room in its list (or pacing it
-- without max_lag). Chosen: the neediest group's fewest minted, then the most groups.
local holding = -1  -- the group whose window holds the shared stream (the slowest pacer)
local function choose()
  local best = nil
  for _, fam in ipairs(fams) do for r = 0, fam.w - 1 do
    local st, front = readers(fam, r)
    local paced, low = true, nil
    for _, c in ipairs(st) do
      if not c.detachable and front >= c.floor + W then
        paced = false
        if low == nil or c.floor < low then low, holding = c.floor, c.slot end
      end
    end
    local seen = {}
    for _, first in ipairs(st) do
      local v, o = first.next, own(first, first.next, fam)
      local key = o < 0 and v or v .. '/' .. o
      if not seen[key] and (v < front or paced) then
        seen[key] = true
        local targets, score, room = {}, nil, false
        for _, c in ipairs(st) do
          local pacing = v == front and not c.detachable and c.max_lag == nil
          if c.next == v and own(c, v, fam) == o and v < c.floor + W and (c.room or pacing) then
            targets[#targets + 1] = c
            room = room or c.room
            if score == nil or c.next - c.floor < score then score = c.next - c.floor end
          end
        end
        if room and (best == nil or score < best.score or
            (score == best.score and #targets > #best.targets) or
            (score == best.score and #targets == #best.targets and v > best.value)) then
          best = {fam = fam, rank = r, value = v, targets = targets, score = score}
        end
      end
    end
  end end
  return best
end

-- Mint the chosen stream's next shard; one every target has already (a resumed ledger)
-- moves their cursors past it and is never built.
for _ = 1, 1000 do
  local best = choose()
  -- Another family's pops may make room as well: wait for any group's.
  if best == nil then return {'WAIT', #fams > 1 and -1 or holding} end
  local r, v, fam = best.rank, best.value, best.fam
  local per = fam.S / fam.w
  local g = math.floor(v / per) * fam.S + (v % per) * fam.w + r
  local mask = 0
  for _, c in ipairs(best.targets) do
    redis.call('HSET', meta_key, 'next' .. reader_sfx(c.slot, r, fam.w), v + 1)
    mask = mask + 2 ^ c.slot
  end
  local want, skip = needed(g, mask, r)
  if want > 0 then return grant(g, want, skip) end
end
return {'WAIT'}
