-- resume.lua: a trainer restarts the plan from its ledger (a checkpoint, or what it had
-- received when Redis lost the queue's state). A new run id makes every producer join
-- again and drop what it was building; the stale contents of the queue go.
-- KEYS[1] meta  KEYS[2] incarnation  KEYS[3] data  KEYS[4] work  KEYS[5] failures
-- KEYS[6] ledger  KEYS[7] wake
-- KEYS[8..] (data-parallel) every rank's data list, this rank's first
-- ARGV[1] claim token  ARGV[2] new run id  ARGV[3] first shard to mint (e * S; a rank:
--         e * P, its local count)
-- ARGV[4] fingerprint  ARGV[5] hwm ('' to let the first producer set it)
-- ARGV[6] S  ARGV[7] window  ARGV[8] batches per epoch
-- ARGV[9] rank  ARGV[10] world size  ARGV[11] 'pad' | 'drop'
-- ARGV[12] the step (batches yielded) the ranks resume from; -1 after Redis lost the
--          queue's state (each rank recovers from its own position)
-- ARGV[13] '1' if this rank held the new run already (the job resumes again): with the
--          run's step its counters start again at ARGV[3], with another step the run
--          starts again from this checkpoint
-- ARGV[14] the epoch whose slots are remapped ('' for none: a job resumed with
--          another number of ranks re-splits its rest, consumer/rank_state.py)
-- ARGV[15] the number of remapped slots m, ARGV[16..15+2m] slot, shard pairs (into
--          the remap hash, the last of KEYS)
-- ARGV[16+2m..] ledger pairs: '<epoch>:<slot>', 'd' or batches already had
-- The ranks of a job resume into one run: the first one creates it (every rank computes
-- the same run id), the others join it and add their ledgers; a rank whose step differs
-- is refused.
-- Returns {'OK', run} or {'CLAIM_LOST'}, {'STEP', the run's step}
local token, new_run, first = ARGV[1], ARGV[2], ARGV[3]
local rank, world, even, step = ARGV[9], tonumber(ARGV[10]), ARGV[11], ARGV[12]
local sfx = ''
if world > 1 then sfx = ':' .. rank end
local m = redis.call('HMGET', KEYS[1], 'claim' .. sfx, 'run', 'resume_step')
if m[1] ~= token then return {'CLAIM_LOST'} end

local remapped = tonumber(ARGV[15] or '0')
local function add_pairs()
  for i = 16 + 2 * remapped, #ARGV, 2 do
    redis.call('HSET', KEYS[6], ARGV[i], ARGV[i + 1])
  end
  if ARGV[14] ~= '' and remapped > 0 then
    for i = 16, 15 + 2 * remapped, 2 do
      redis.call('HSET', KEYS[#KEYS], ARGV[i], ARGV[i + 1])
    end
    redis.call('HSET', KEYS[1], 'remap_epoch', ARGV[14])
  end
end

local again = ARGV[13] == '1' and m[3] ~= step  -- the job resumes another checkpoint
-- Step -1: not a checkpoint but Redis' lost state: each rank is where it is, so each
-- sets only its own counters (a rank's neighbours may be in another epoch).
local recovering = step == '-1'
if m[2] == new_run and not again then
  -- A retried resume whose first reply was lost, or another rank of the job resumed
  -- first: producers may have pushed frames of the new run already; keep them.
  if world > 1 and m[3] and m[3] ~= step then return {'STEP', m[3]} end
  if ARGV[13] == '1' then
    redis.call('HSET', KEYS[1], 'next' .. sfx, first, 'floor' .. sfx, first)
    if world > 1 then redis.call('DEL', KEYS[8]) end
  elseif recovering then
    redis.call('HSET', KEYS[1], 'next' .. sfx, first, 'floor' .. sfx, first)
  end
  add_pairs()
  return {'OK', new_run}
end
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6])
for i = 8, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('HDEL', KEYS[1], 'finished', 'finished_at', 'hwm', 'shards', 'window',
  'epoch_batches', 'world', 'even', 'resume_step', 'remap_epoch')
redis.call('HSET', KEYS[1], 'run', new_run, 'next', first, 'floor', first,
  'fingerprint', ARGV[4])
if world > 1 then
  redis.call('HSET', KEYS[1], 'world', world, 'even', even, 'resume_step', step)
  for r = 0, world - 1 do
    if not recovering or tostring(r) == rank then
      redis.call('HSET', KEYS[1], 'next:' .. r, first, 'floor:' .. r, first)
    end
    -- Ranks join the new run by resuming into it: none has held it yet, but this one.
    redis.call('HDEL', KEYS[1], 'done:' .. r)
    if tostring(r) ~= rank then redis.call('HDEL', KEYS[1], 'claimed:' .. r) end
  end
end
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'hwm', ARGV[5], 'shards', ARGV[6], 'window', ARGV[7],
    'epoch_batches', ARGV[8])
end
add_pairs()
redis.call('LPUSH', KEYS[7], '1')
redis.call('LTRIM', KEYS[7], 0, 7)
return {'OK', new_run}
