-- claim.lua: a trainer (one rank of a job) acquires, refreshes, releases or finishes its
-- claim on the run.
-- A rank's claim lives in meta fields '<name>:<rank>' (world 1: '<name>'), see
-- batchq/protocol/ranks.py.
-- acquire returns {'OK', incarnation, run, new_run (0/1), fence[, held (world > 1; 0/1:
--              this rank had claimed the resumed run `resumed` before)]}
--              or {'CONFLICT', ms until the other claim lapses},
--                 {'WORLD', the run's world size} (a live rank of the run has another)
-- acquire and finish return {'GROUPS'} for a run read by several groups (gclaim.lua's)
-- refresh/release/finish return {'OK'}, {'CLAIM_LOST'} or {'STATE_LOST'}; a rank's finish returns
--              {'OK', 1} when it was the last rank (the run ended), else {'OK', 0}
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local data_key = KEYS[3]         -- LIST
local work_key = KEYS[4]         -- LIST   shards handed back
local wake_key = KEYS[5]         -- LIST
local failures_key = KEYS[6]     -- HASH
local ledger_key = KEYS[7]       -- HASH
-- KEYS[8..]: (data-parallel) every rank's data list, the counts and remap hashes:
-- dropped with the run
local token = ARGV[1]            -- the trainer's claim token
local claim_ttl_ms = tonumber(ARGV[2])
local op = ARGV[3]               -- 'acquire' | 'refresh' | 'release' | 'finish'
local run_id = ARGV[4]           -- run id to use if a new run starts
local new_incarnation = ARGV[5]  -- incarnation to use if the queue must be created
local takeover_run = ARGV[6]     -- run id to take over ('' for none)
local version = ARGV[7]          -- protocol version
local rank = ARGV[8] or '0'
local world = tonumber(ARGV[9] or '1')
local even = ARGV[10] or 'pad'   -- 'pad' | 'drop'
local resumed = ARGV[11] or ''   -- a second run id to take over: the run that the job's
                                 -- first resuming rank created (resume.lua), or ''
local incarnation = ARGV[12] or ''  -- refresh/release/finish: the queue's incarnation the
                                 -- claim was made in (another, or none: Redis lost the
                                 -- queue, STATE_LOST; not a takeover); acquire: ''
local first_rank_data = 8

local now = server_now_ms()
local function f(name, r)
  if world == 1 then return name end
  return name .. ':' .. (r or rank)
end
local m = redis.call('HMGET', meta_key, 'run', f('claim'), f('claim_deadline'), f('claimed'),
  'finished', 'world')
local run_world = tonumber(m[6] or '1')

-- Whether any rank of the run other than this one holds a live claim.
local function others_live()
  for r = 0, run_world - 1 do
    if run_world == 1 or tostring(r) ~= rank then
      local name = 'claim_deadline'
      if run_world > 1 then name = name .. ':' .. r end
      if tonumber(redis.call('HGET', meta_key, name) or '0') > now then return true end
    end
  end
  return false
end

-- A retried finish whose first reply was lost: the run (or this rank) is finished.
if op == 'finish' and m[5] == '1' then return {'OK', 1} end
-- A run read by several groups is gclaim.lua's (batchq/protocol/groups.py): its groups'
-- keys go with it, and a finish ends it only with the last group.
if (op == 'acquire' or op == 'finish') and redis.call('HGET', meta_key, 'groups') then
  return {'GROUPS'}
end
if op == 'finish' and world > 1 and not m[2] and redis.call('HGET', meta_key, f('done')) == '1' then
  return {'OK', 0}
end
if op ~= 'acquire' then
  if incarnation ~= '' and redis.call('GET', incarnation_key) ~= incarnation then
    return {'STATE_LOST'}
  end
  if m[2] ~= token then return {'CLAIM_LOST'} end
  if op == 'refresh' then
    redis.call('HSET', meta_key, f('claim_deadline'), now + claim_ttl_ms)
  elseif op == 'release' then
    redis.call('HDEL', meta_key, f('claim'), f('claim_deadline'))
  elseif op == 'finish' then
    redis.call('HDEL', meta_key, f('claim'), f('claim_deadline'))
    if world > 1 then
      -- Every rank finishes the run; the last one ends it.
      redis.call('HSET', meta_key, f('done'), 1)
      for r = 0, world - 1 do
        if redis.call('HGET', meta_key, f('done', r)) ~= '1' then return {'OK', 0} end
      end
    end
    -- Producers see 'finished' on their next call and exit; the frames left are useless.
    redis.call('DEL', data_key, work_key, wake_key, failures_key)
    for i = first_rank_data, #KEYS do redis.call('DEL', KEYS[i]) end
    redis.call('HSET', meta_key, 'finished', 1, 'finished_at', now)
    if world > 1 then return {'OK', 1} end
  end
  return {'OK'}
end

local inc = redis.call('GET', incarnation_key)
if m[2] == token and m[1] and inc and m[5] ~= '1' then
  -- A retried acquire whose first reply was lost: this trainer holds the claim already.
  -- new_run is 1 if that first try started the run (it minted the run id run_id).
  redis.call('HSET', meta_key, f('claim_deadline'), now + claim_ttl_ms)
  redis.call('HDEL', meta_key, f('shm_host'), f('shm_lookahead'))
  local again = 0
  if m[1] == run_id then again = 1 end
  return {'OK', inc, m[1], again, tonumber(redis.call('HGET', meta_key, 'fence') or 0)}
end

local takeover = m[1] and ((takeover_run ~= '' and takeover_run == m[1]) or
  (resumed ~= '' and resumed == m[1]))
if m[2] and m[2] ~= token and tonumber(m[3] or 0) > now and not takeover then
  return {'CONFLICT', tonumber(m[3]) - now}
end

local new_run, held = 0, 0
if m[4] == '1' and resumed ~= '' and m[1] == resumed then held = 1 end
if not inc then
  inc = new_incarnation
  redis.call('SET', incarnation_key, inc)
  m[1] = false
end
local other_world = m[1] and m[5] ~= '1' and run_world ~= world and not takeover
if other_world and others_live() then return {'WORLD', run_world} end
if (not m[1]) or m[5] == '1' or (m[4] == '1' and not takeover) or other_world then
  -- No run, a finished run, one that an earlier trainer of this rank held, or one of
  -- another world size that nobody holds: start a new run. The producers see
  -- RUN_CHANGED and join it; frames of the old run are dropped here and, should any
  -- still arrive, by the trainer (the run id is in every frame).
  redis.call('DEL', meta_key, data_key, work_key, wake_key, failures_key, ledger_key)
  for i = first_rank_data, #KEYS do redis.call('DEL', KEYS[i]) end
  redis.call('HSET', meta_key, 'version', version, 'run', run_id, 'next', 0, 'floor', 0)
  if world > 1 then
    redis.call('HSET', meta_key, 'world', world, 'even', even)
    for r = 0, world - 1 do
      redis.call('HSET', meta_key, 'next:' .. r, 0, 'floor:' .. r, 0)
    end
  end
  m[1] = run_id
  new_run, held = 1, 0
end
redis.call('HSET', meta_key, f('claim'), token, f('claim_deadline'), now + claim_ttl_ms,
  f('claimed'), 1)
-- The previous trainer's host goes: until this one publishes its own (right after),
-- no shared-memory descriptor is pushed for this rank (push.lua), so none of another
-- host's can reach it.
redis.call('HDEL', meta_key, f('shm_host'), f('shm_lookahead'))
local fence = redis.call('HINCRBY', meta_key, 'fence', 1)
if world == 1 then return {'OK', inc, m[1], new_run, fence} end
return {'OK', inc, m[1], new_run, fence, held}
