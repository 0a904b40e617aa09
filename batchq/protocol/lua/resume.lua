-- resume.lua: a trainer (one rank of one group) restarts its group's plan from its ledger:
-- a checkpoint, or what it had received when Redis lost the queue's state. A new run id
-- makes every producer join again and drop what it was building.
-- Returns {'OK', run, slot, groups}, {'CLAIM_LOST'}, {'STEP', step}, {'GROUPS', groups}
-- The default group of a run of one group takes the fast path: the ranks of a job resume
-- into one run, the first creating it (docs/design.md "Resume", "Data-parallel trainers").
-- A run of several groups lives on when it is the checkpoint's (or another group's resume
-- of it): only this group's cursors and ledger change ("Several groups").
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING (kept for the key layout)
local data_key = KEYS[3]         -- LIST   (dropped with a run)
local groups_key = KEYS[4]       -- HASH   group name -> slot
local work_key = KEYS[5]         -- LIST   shards handed back
local wake_key = KEYS[6]         -- LIST
local failures_key = KEYS[7]     -- HASH
local refs_key = KEYS[8]         -- HASH   frame key -> readers left
local remap_key = KEYS[9]        -- HASH   slot -> shard (an elastic resume's)
-- KEYS[10..]: the keys of group slots 0..max(groups, 1), as claim.lua's
local token = ARGV[1]            -- the trainer's claim token
local new_run = ARGV[2]          -- the run a replaced run becomes
local takeover_run = ARGV[3]     -- the checkpoint's run: it lives on if the queue runs it
local first = ARGV[4]            -- first shard to mint (e * S; a rank: e * P, its count)
local fingerprint = ARGV[5]
local hwm = ARGV[6]              -- '' to let the first producer set the plan's figures
local shards = ARGV[7]           -- S
local window = ARGV[8]
local epoch_batches = ARGV[9]
local group = ARGV[10]           -- the group's name ('' the default group)
local rank = ARGV[11]
local world = tonumber(ARGV[12])
local even = ARGV[13]            -- 'pad' | 'drop'
local step = ARGV[14]            -- the checkpoint's batches yielded; -1: Redis lost the state
local held = ARGV[15]            -- '1': this rank held the resumed run already (resumed again)
local groups = tonumber(ARGV[16])  -- the group slots the run had when the caller looked
local key_world = tonumber(ARGV[17])  -- the ranks the KEYS tail has keys for, per slot
local slot_arg = tonumber(ARGV[18])  -- the slot the caller's claim was made for
local acquired = ARGV[19]        -- the run the caller's claim was made in
local claim_ttl_ms = tonumber(ARGV[20])
local wake_cap = tonumber(ARGV[21])  -- the wake list's length cap
local remap_epoch = ARGV[22]     -- the epoch an elastic resume remapped, or ''
local remapped = tonumber(ARGV[23])  -- the number r of remapped slots
local keep = ARGV[24]            -- a single trainer's state's position (checkpoint.py), or ''
-- ARGV[25..]: r slot, shard pairs (into the remap hash), then the ledger pairs
-- '<epoch>:<slot>', 'd' or batches already had
local first_remap = 25
local first_tail, first_pair = 10, first_remap + 2 * remapped

local per, tail_slots, slot_key, lists = slot_tail(KEYS, first_tail, key_world, groups)
if not per then return redis.error_reply('resume.lua: KEYS do not cover the group slots') end

local m = redis.call('HMGET', meta_key, 'run', 'finished', 'world', 'groups', 'params',
  'detached')
local n = tonumber(m[4] or '0')
-- The checkpoint is where its single trainer detached (detach.lua), and the run is as it
-- left it (unfinished, one rank, no params log of its own or just loaded for new_run: the
-- state's would be written as another run's): its list holds every frame not yielded,
-- so nothing is rebuilt (design.md "Resume").
local stamp = m[5] or ''
local logged = string.sub(stamp, 1, #takeover_run + 1) == takeover_run .. ':' or
  string.sub(stamp, 1, #new_run + 1) == new_run .. ':'
local reattach = keep ~= '' and world == 1 and m[1] and m[1] == takeover_run and not m[2] and
  tonumber(m[3] or '1') == 1 and not logged and m[6] == takeover_run .. ':' .. keep
if n ~= groups or key_world < math.max(world, max_world(meta_key, n)) then
  return {'GROUPS', n}
end
local function wake()
  redis.call('LPUSH', wake_key, '1')
  redis.call('LTRIM', wake_key, 0, wake_cap - 1)
end
-- An elastic resume's remapped slots into slot i's remap (slot 0's: the run's remap), for
-- the epoch meta remap_epoch[@<i>] names; then the ledger pairs into slot i's ledger.
local function add_pairs(i)
  if remap_epoch ~= '' and remapped > 0 then
    local key = slot_key(i, per - 2)
    for a = first_remap, first_pair - 1, 2 do redis.call('HSET', key, ARGV[a], ARGV[a + 1]) end
    redis.call('HSET', meta_key, 'remap_epoch' .. reader_sfx(i, 0, 1), remap_epoch)
    if i > 0 then redis.call('HSET', meta_key, 'mixed_worlds', 1) end  -- lease.lua reads it
  end
  for a = first_pair, #ARGV, 2 do redis.call('HSET', slot_key(i, 0), ARGV[a], ARGV[a + 1]) end
end
-- The plan's figures, unless the first producer is to set them.
local function set_plan()
  if hwm == '' then return end
  redis.call('HSET', meta_key, 'hwm', hwm, 'shards', shards, 'window', window,
    'epoch_batches', epoch_batches)
end

if n == 0 and group == '' then
  -- The fast path: the default group of a run not read by several groups.
  local sfx = reader_sfx(0, rank, world)
  local ledger_key = slot_key(0, 0)
  m = redis.call('HMGET', meta_key, 'claim' .. sfx, 'run', 'resume_step')
  if m[1] ~= token then return {'CLAIM_LOST'} end
  local again = held == '1' and m[3] ~= step  -- the job resumes another checkpoint
  -- Step -1: not a checkpoint but Redis' lost state: each rank is where it is, so each
  -- sets only its own counters (a rank's neighbours may be in another epoch).
  local recovering = step == '-1'
  if reattach then
    -- Its list, leases, cursor and floor stand: the trainer reads on where it left.
    redis.call('HDEL', meta_key, 'detached')
    return {'OK', takeover_run, 0, 0}
  end
  if m[2] == new_run and not again then
    -- A retried resume whose first reply was lost, or another rank of the job resumed
    -- first: producers may have pushed frames of the new run already; keep them.
    if world > 1 and m[3] and m[3] ~= step then return {'STEP', m[3]} end
    if held == '1' or recovering then
      redis.call('HSET', meta_key, 'next' .. sfx, first, 'floor' .. sfx, first)
      if held == '1' and world > 1 then redis.call('DEL', slot_key(0, 2 + tonumber(rank))) end
    end
    add_pairs(0)
    return {'OK', new_run, 0, 0}
  end
  redis.call('DEL', data_key, work_key, failures_key, ledger_key)
  if world > 1 then
    for j = 1, 1 + lists do redis.call('DEL', slot_key(0, j)) end  -- counts, lists
    redis.call('DEL', remap_key)
  end
  redis.call('HDEL', meta_key, 'finished', 'finished_at', 'version', 'hwm', 'shards', 'window',
    'epoch_batches', 'world', 'even', 'resume_step', 'remap_epoch', 'shm_host', 'shm_lookahead')
  redis.call('HSET', meta_key, 'run', new_run, 'next', first, 'floor', first,
    'fingerprint', fingerprint)
  if world > 1 then
    redis.call('HSET', meta_key, 'world', world, 'even', even, 'resume_step', step)
    for r = 0, world - 1 do
      if not recovering or tostring(r) == rank then
        redis.call('HSET', meta_key, 'next:' .. r, first, 'floor:' .. r, first)
      end
      -- Ranks join the new run by resuming into it: none has held it yet, but this one.
      -- Each publishes its host again once resumed (the previous job's may be elsewhere).
      redis.call('HDEL', meta_key, 'done:' .. r, 'shm_host:' .. r, 'shm_lookahead:' .. r)
      if tostring(r) ~= rank then redis.call('HDEL', meta_key, 'claimed:' .. r) end
    end
  end
  set_plan()
  add_pairs(0)
  wake()
  return {'OK', new_run, 0, 0}
end

-- A named group, or a run read by several groups.
local function field(name, i, r) return name .. reader_sfx(i, r or rank, world) end
-- The caller holds its claim in the run it acquired; a run another group's resume made
-- of the same checkpoint (new_run) it joins.
if m[1] == acquired then
  if redis.call('HGET', meta_key, field('claim', slot_arg)) ~= token then return {'CLAIM_LOST'} end
elseif m[1] ~= new_run then
  return {'CLAIM_LOST'}
end
local deadline = server_now_ms() + claim_ttl_ms

local slot
local lives = m[1] and m[2] ~= '1' and (m[1] == new_run or m[1] == takeover_run)
if not lives then
  -- Replace the run: its contents and every group's place go; this group takes slot 0.
  redis.call('DEL', work_key, failures_key, refs_key, groups_key, remap_key)
  for i = 0, tail_slots - 1 do
    for j = 0, per - 1 do
      if not (i == 0 and j >= 2 + lists) then redis.call('DEL', slot_key(i, j)) end
    end
    for r = 0, lists - 1 do
      local sfx = reader_sfx(i, r, r < key_world and key_world or 1)
      redis.call('HDEL', meta_key, 'claim' .. sfx, 'claim_deadline' .. sfx, 'claimed' .. sfx,
        'done' .. sfx, 'next' .. sfx, 'floor' .. sfx, 'shm_host' .. sfx, 'shm_lookahead' .. sfx)
    end
    redis.call('HDEL', meta_key, 'max_lag' .. reader_sfx(i, 0, 1),
      'resume_step' .. reader_sfx(i, 0, 1), 'world@' .. i, 'even@' .. i, 'remap_epoch@' .. i)
  end
  redis.call('HDEL', meta_key, 'finished', 'finished_at', 'version', 'hwm', 'shards', 'window',
    'epoch_batches', 'world', 'even', 'resume_step', 'remap_epoch', 'groups', 'mixed_worlds')
  redis.call('HSET', meta_key, 'run', new_run, 'fingerprint', fingerprint)
  if world > 1 then redis.call('HSET', meta_key, 'world', world, 'even', even) end
  set_plan()
  n, slot = 0, 0
  if group ~= '' then
    redis.call('HSET', groups_key, group, 0)
    redis.call('HSET', meta_key, 'groups', 1)
    n = 1
  end
  for r = 0, world - 1 do
    redis.call('HSET', meta_key, field('next', 0, r), first, field('floor', 0, r), first)
  end
else
  local s = redis.call('HGET', groups_key, group)
  if s then
    slot = tonumber(s)
  else
    -- This group's place went with a run another group's resume replaced: a new one.
    slot = n
    for j = 0, per - 1 do redis.call('DEL', slot_key(slot, j)) end
    for r = 0, world - 1 do
      redis.call('HSET', meta_key, field('next', slot, r), first, field('floor', slot, r), first)
    end
    n = n + 1
    redis.call('HSET', groups_key, group, slot)
    redis.call('HSET', meta_key, 'groups', n)
    local sfx = reader_sfx(slot, 0, 1)
    redis.call('HSET', meta_key, 'world' .. sfx, world, 'even' .. sfx, even, 'mixed_worlds', 1)
  end
end
-- The caller claims its rank of the slot, unless another holds it live (a replaced run's
-- claims went with it).
local claim = redis.call('HMGET', meta_key, field('claim', slot), field('claim_deadline', slot))
if claim[1] ~= token then
  if claim[1] and tonumber(claim[2] or '0') > server_now_ms() then return {'CLAIM_LOST'} end
  redis.call('HSET', meta_key, field('claim', slot), token, field('claim_deadline', slot),
    deadline, field('claimed', slot), 1)
end
if world > 1 and step ~= '-1' then  -- (a replaced run has no resume_step left)
  local rs = redis.call('HGET', meta_key, 'resume_step' .. reader_sfx(slot, 0, 1))
  if rs and rs ~= step and held ~= '1' then return {'STEP', rs} end
  -- The first rank of this resume: the group's counts (balance.py) are the run's before.
  if rs ~= step then redis.call('DEL', slot_key(slot, 1)) end
  redis.call('HSET', meta_key, 'resume_step' .. reader_sfx(slot, 0, 1), step)
end

-- This rank's place: the checkpoint's epoch, and what it has of it.
redis.call('HSET', meta_key, field('next', slot), first, field('floor', slot), first)
redis.call('HDEL', meta_key, field('done', slot))
local ledger_key = slot_key(slot, 0)
if world == 1 then
  redis.call('DEL', ledger_key)
else
  local pairs_had = redis.call('HGETALL', ledger_key)
  for i = 1, #pairs_had, 2 do
    local s = tonumber(string.match(pairs_had[i], ':(%d+)$') or '-1')
    if s % world == tonumber(rank) then redis.call('HDEL', ledger_key, pairs_had[i]) end
  end
end
add_pairs(slot)
wake()
return {'OK', lives and m[1] or new_run, slot, n}
