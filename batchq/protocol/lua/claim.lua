-- claim.lua: a trainer (one rank of one group) acquires, refreshes, releases or finishes
-- its claim on the run, in meta fields '<name>' + reader_sfx(slot, rank, world)
-- (batchq/protocol/groups.py reader_field). How groups take slots, join late, restart and
-- retire: docs/design.md "Several groups".
-- acquire returns {'OK', incarnation, run, new_run, fence, held, slot, groups[, retired]},
--   {'CONFLICT', ms, holder}, {'WORLD', world} (a live rank has another), {'FULL', groups},
--   {'GROUPS', groups}; refresh/release {'OK'}, {'CLAIM_LOST'} or {'STATE_LOST'}; finish
--   {'OK', group done, run ended}: ClaimReply (trainer_scripts.py) says what each is
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local data_key = KEYS[3]         -- LIST   (dropped with a run)
local groups_key = KEYS[4]       -- HASH   group name -> slot
local work_key = KEYS[5]         -- LIST   shards handed back
local wake_key = KEYS[6]         -- LIST
local failures_key = KEYS[7]     -- HASH
local refs_key = KEYS[8]         -- HASH   frame key -> readers left
local remap_key = KEYS[9]        -- HASH   (an elastic resume's; dropped with a run)
-- KEYS[10..]: the keys of group slots 0..max(groups, 1), each slot's in a row (lib/shared.lua's
-- slot_tail): what a new or finished run drops, and a new slot clears
local token = ARGV[1]            -- the trainer's claim token
local claim_ttl_ms = tonumber(ARGV[2])
local op = ARGV[3]               -- 'acquire' | 'refresh' | 'release' | 'finish'
local run_id = ARGV[4]           -- run id to use if a new run starts
local new_incarnation = ARGV[5]  -- incarnation to use if the queue must be created
local takeover_run = ARGV[6]     -- run id to take over ('' for none)
local version = ARGV[7]          -- protocol version
local group = ARGV[8]            -- the group's name ('' the default group)
local rank = ARGV[9]
local world = tonumber(ARGV[10])
local even = ARGV[11]            -- 'pad' | 'drop'
local resumed = ARGV[12]         -- a run to take over too: the job's first resumed one, or ''
local incarnation = ARGV[13]     -- the claim's ('' to acquire; another: STATE_LOST)
local groups = tonumber(ARGV[14])  -- the group slots the run had when the caller looked
local key_world = tonumber(ARGV[15])  -- the ranks the KEYS tail has keys for, per slot
local max_lag = ARGV[16]         -- acquire: the group's max_lag_batches ('' for none)
local slot_arg = tonumber(ARGV[17])  -- refresh/release/finish: the caller's slot
local max_groups = tonumber(ARGV[18])  -- the most group slots a run has
local name = ARGV[19]            -- acquire: the CLIENT SETNAME of the caller's connections
local dead = ARGV[20]            -- acquire: a holder's name with no connection left (died)
local first_tail = 10

local now = server_now_ms()
local per, tail_slots, slot_key, lists = slot_tail(KEYS, first_tail, key_world, groups)
if not per then return redis.error_reply('claim.lua: KEYS do not cover the group slots') end
-- Delete a slot's keys (its figures too, but for slot 0, whose are the queue's own).
local function drop_slot(i, keep_figures)
  for j = 0, per - 1 do
    local figure = j >= 2 + lists and j < per - 2
    if not (keep_figures and figure) then redis.call('DEL', slot_key(i, j)) end
  end
end
local m = redis.call('HMGET', meta_key, 'run', 'finished', 'world', 'groups')
local run_world = tonumber(m[3] or '1')
local n = tonumber(m[4] or '0')
if op == 'acquire' and (n ~= groups or key_world < math.max(world, max_world(meta_key, n))) then
  return {'GROUPS', n}
end
local slot = slot_arg
local function f(name, r) return name .. reader_sfx(slot, r or rank, world) end

-- The default group of a run of one group in world 1: a single trainer, no 'done' field.
local single = n == 0 and world == 1 and group == ''
-- Whether test(meta field `name` of a rank) holds for some rank of slot i (but `except`).
local function some_rank(i, name, test, except)
  local w = slot_world(meta_key, i)
  for r = 0, w - 1 do
    if (w == 1 or tostring(r) ~= except) and
        test(redis.call('HGET', meta_key, name .. reader_sfx(i, r, w))) then
      return true
    end
  end
  return false
end
local function group_done(i)
  return not some_rank(i, 'done', function(v) return v ~= '1' end)
end

if op ~= 'acquire' then
  -- A retried finish whose first reply was lost: the run (or this rank) is finished.
  if op == 'finish' and m[2] == '1' then return {'OK', 1, 1} end
  if incarnation ~= '' and redis.call('GET', incarnation_key) ~= incarnation then
    return {'STATE_LOST'}
  end
  local claim = redis.call('HGET', meta_key, f('claim'))
  if op == 'finish' and not claim and redis.call('HGET', meta_key, f('done')) == '1' then
    return {'OK', group_done(slot) and 1 or 0, 0}
  end
  if claim ~= token then return {'CLAIM_LOST'} end
  if op == 'refresh' then
    redis.call('HSET', meta_key, f('claim_deadline'), now + claim_ttl_ms)
    return {'OK'}
  end
  redis.call('HDEL', meta_key, f('claim'), f('claim_deadline'))
  if op == 'release' then return {'OK'} end
  if not single then redis.call('HSET', meta_key, f('done'), 1) end
  local done = single or group_done(slot)
  for i = 0, math.max(n, 1) - 1 do
    if not (single or group_done(i)) then return {'OK', done and 1 or 0, 0} end
  end
  -- Every group finished: producers see 'finished' and exit; the frames left are useless.
  redis.call('DEL', data_key, work_key, wake_key, failures_key, refs_key, remap_key)
  for i = 0, tail_slots - 1 do
    for j = 1, 1 + lists do redis.call('DEL', slot_key(i, j)) end  -- counts, lists
    -- Its wake list (no producer waits for a finished run: issue 42) and remap.
    redis.call('DEL', slot_key(i, per - 1), slot_key(i, per - 2))
  end
  redis.call('HSET', meta_key, 'finished', 1, 'finished_at', now)
  return {'OK', 1, 1}
end

local inc = redis.call('GET', incarnation_key)
if not inc then
  inc = new_incarnation
  redis.call('SET', incarnation_key, inc)
  m[1] = false
end
local takeover = m[1] and ((takeover_run ~= '' and takeover_run == m[1]) or
  (resumed ~= '' and resumed == m[1]))
local new_run, retired = 0, -1

local function start_run()
  redis.call('DEL', meta_key, data_key, work_key, wake_key, failures_key, refs_key, groups_key,
    remap_key)
  for i = 0, math.max(n, 1) - 1 do drop_slot(i, i == 0) end
  redis.call('HSET', meta_key, 'version', version, 'run', run_id, 'next', 0, 'floor', 0)
  if world > 1 then
    redis.call('HSET', meta_key, 'world', world, 'even', even)
    for r = 0, world - 1 do redis.call('HSET', meta_key, 'next:' .. r, 0, 'floor:' .. r, 0) end
  end
  m[1], new_run, n, run_world = run_id, 1, 0, world
end
-- Name `name` the group of slot i; a fresh slot's keys (an earlier run's) go, its world
-- is this trainer's (each group reads with its own) and its cursors start at 0 (slot 0
-- of a live run keeps its own: its reader, or the producers' work done before any
-- trainer came).
local function register(name, i, fresh)
  redis.call('HSET', groups_key, name, i)
  if fresh then
    drop_slot(i, false)
    redis.call('HSET', meta_key, 'world@' .. i, world, 'even@' .. i, even)
    if world ~= run_world or (world > 1 and even ~= redis.call('HGET', meta_key, 'even')) then
      redis.call('HSET', meta_key, 'mixed_worlds', 1)  -- lease.lua reads each slot's then
    end
    for r = 0, world - 1 do
      local sfx = reader_sfx(i, r, world)
      redis.call('HSET', meta_key, 'next' .. sfx, 0, 'floor' .. sfx, 0)
    end
  end
  n = math.max(n, i + 1)
  redis.call('HSET', meta_key, 'groups', n)
end
-- Whether a rank of slot i (but `except`, in a run of several ranks) holds a live claim.
local function live(i, except)
  return some_rank(i, 'claim_deadline', function(d) return tonumber(d or '0') > now end, except)
end
-- A new run for this group alone (a run of the default group alone stays unregistered):
-- the producers see RUN_CHANGED and join it; frames of the old run are dropped here and,
-- should any still arrive, by the trainer (the run id is in every frame).
local function alone()
  start_run()
  if group ~= '' then register(group, 0, false) end
  return 0
end

if (not m[1]) or m[2] == '1' then
  slot = alone()
elseif n == 0 and group == '' then
  -- The default group of a run not read by several groups: a run of another world size
  -- that no other rank holds starts again (one this job resumes is taken over).
  slot = 0
  if run_world ~= world and not takeover then
    if live(0, rank) then return {'WORLD', run_world} end
    slot = alone()
  end
elseif n == 0 then
  redis.call('DEL', groups_key)  -- names left by an earlier run
  if some_rank(0, 'claimed', function(v) return v == '1' end) then
    -- A trainer without group reads the run: it keeps slot 0, this group joins late.
    register('', 0, false)
    register(group, 1, true)
    slot = 1
  else
    -- Nobody claimed the run yet: this group takes what producers built already.
    if run_world ~= world then slot = alone() else register(group, 0, false); slot = 0 end
  end
else
  local s = redis.call('HGET', groups_key, group)
  if s then
    slot = tonumber(s)
    local w = slot_world(meta_key, slot)
    if w ~= world then
      -- The group comes back with another number of ranks (an elastic resume) while the
      -- others read on: it reads a new slot of its world, and its old slot retires (every
      -- rank done: no push targets it, a lease in flight for it leaves it out; the caller
      -- drains its lists). Refused while a rank of it is live, but by a takeover.
      if live(slot) and not takeover then return {'WORLD', w} end
      if n >= max_groups then return {'FULL', n} end
      for r = 0, w - 1 do
        local sfx = reader_sfx(slot, r, w)
        redis.call('HSET', meta_key, 'done' .. sfx, 1)
        redis.call('HDEL', meta_key, 'claim' .. sfx, 'claim_deadline' .. sfx)
      end
      retired, slot = slot, n
      register(group, slot, true)
      -- Resuming: nothing is minted for its ranks before their resume (resume.lua clears
      -- each one's done) put their cursors and remap in place.
      for r = 0, takeover and world - 1 or -1 do
        redis.call('HSET', meta_key, 'done' .. reader_sfx(slot, r, world), 1)
      end
    end
  else
    if n >= max_groups then return {'FULL', n} end
    slot = n
    register(group, slot, true)
  end
end

local c = redis.call('HMGET', meta_key, f('claim'), f('claim_deadline'), f('claimed'),
  f('claim_client'))
if c[1] == token and new_run == 0 then
  -- A retried acquire whose first reply was lost: this trainer holds the claim already.
  redis.call('HSET', meta_key, f('claim_deadline'), now + claim_ttl_ms)
  redis.call('HDEL', meta_key, f('shm_host'), f('shm_lookahead'))
  local fence = tonumber(redis.call('HGET', meta_key, 'fence') or 0)
  return {'OK', inc, m[1], m[1] == run_id and 1 or 0, fence, 0, slot, n}
end
if c[1] and c[1] ~= token and tonumber(c[2] or 0) > now and not takeover and
    not (dead ~= '' and c[4] == dead) then
  return {'CONFLICT', tonumber(c[2]) - now, c[4] or ''}
end
local held = (c[3] == '1' and resumed ~= '' and m[1] == resumed and not single) and 1 or 0
if new_run == 0 and c[3] == '1' and not takeover then
  -- This rank read its group before and comes back without a checkpoint.
  if n <= 1 then
    slot = alone()
  else
    -- The others read on: this group starts its epochs again, as one that joins late
    -- (its list keeps what was pushed for it: the same run's batches, filed or dropped
    -- by its ledger like any). Its other ranks' claims go (they read the old position).
    for r = 0, world - 1 do
      local sfx = reader_sfx(slot, r, world)
      redis.call('HSET', meta_key, 'next' .. sfx, 0, 'floor' .. sfx, 0)
      redis.call('HDEL', meta_key, 'done' .. sfx, 'claim' .. sfx, 'claim_deadline' .. sfx,
        'claimed' .. sfx)
    end
    redis.call('DEL', slot_key(slot, 0), slot_key(slot, 1), slot_key(slot, per - 2))
    redis.call('HDEL', meta_key, 'remap_epoch' .. reader_sfx(slot, 0, 1))  -- and remap
  end
end
redis.call('HSET', meta_key, f('claim'), token, f('claim_deadline'), now + claim_ttl_ms,
  f('claimed'), 1, f('claim_client'), name)
-- The previous trainer's host goes: until this one publishes its own (right after), no
-- shared-memory descriptor is pushed for this rank (push.lua), so none of another host's
-- can reach it.
redis.call('HDEL', meta_key, f('shm_host'), f('shm_lookahead'))
if n > 0 and max_lag ~= '' then
  redis.call('HSET', meta_key, 'max_lag' .. reader_sfx(slot, 0, 1), max_lag)
elseif n > 0 then
  redis.call('HDEL', meta_key, 'max_lag' .. reader_sfx(slot, 0, 1))
end
local fence = redis.call('HINCRBY', meta_key, 'fence', 1)
if retired < 0 then return {'OK', inc, m[1], new_run, fence, held, slot, n} end
return {'OK', inc, m[1], new_run, fence, held, slot, n, retired}
