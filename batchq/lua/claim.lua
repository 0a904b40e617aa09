-- claim.lua: the trainer acquires, refreshes, releases or finishes its claim on the run.
-- KEYS[1] meta  KEYS[2] incarnation  KEYS[3] data  KEYS[4] work  KEYS[5] wake
-- KEYS[6] failures  KEYS[7] ledger
-- ARGV[1] claim token  ARGV[2] claim ttl (ms)
-- ARGV[3] 'acquire' | 'refresh' | 'release' | 'finish'
-- ARGV[4] run id to use if a new run starts  ARGV[5] incarnation to use if the queue
--         must be created  ARGV[6] run id to take over ('' for none)
-- ARGV[7] protocol version
-- acquire returns {'OK', incarnation, run, new_run (0/1), fence}
--              or {'CONFLICT', ms until the other claim lapses}
-- refresh/release/finish return {'OK'} or {'CLAIM_LOST'}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op = ARGV[3]
local m = redis.call('HMGET', KEYS[1], 'run', 'claim', 'claim_deadline', 'claimed', 'finished')

-- A retried finish whose first reply was lost: the run is finished already.
if op == 'finish' and m[5] == '1' then return {'OK'} end
if op ~= 'acquire' then
  if m[2] ~= ARGV[1] then return {'CLAIM_LOST'} end
  if op == 'refresh' then
    redis.call('HSET', KEYS[1], 'claim_deadline', now + tonumber(ARGV[2]))
  elseif op == 'release' then
    redis.call('HDEL', KEYS[1], 'claim', 'claim_deadline')
  elseif op == 'finish' then
    -- Producers see 'finished' on their next call and exit; the frames left are useless.
    redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6])
    redis.call('HSET', KEYS[1], 'finished', 1, 'finished_at', now)
    redis.call('HDEL', KEYS[1], 'claim', 'claim_deadline')
  end
  return {'OK'}
end

local inc = redis.call('GET', KEYS[2])
if m[2] == ARGV[1] and m[1] and inc and m[5] ~= '1' then
  -- A retried acquire whose first reply was lost: this trainer holds the claim already.
  -- new_run is 1 if that first try started the run (it minted the run id ARGV[4]).
  redis.call('HSET', KEYS[1], 'claim_deadline', now + tonumber(ARGV[2]))
  local again = 0
  if m[1] == ARGV[4] then again = 1 end
  return {'OK', inc, m[1], again, tonumber(redis.call('HGET', KEYS[1], 'fence') or 0)}
end

local takeover = ARGV[6] ~= '' and ARGV[6] == m[1]
if m[2] and m[2] ~= ARGV[1] and tonumber(m[3] or 0) > now and not takeover then
  return {'CONFLICT', tonumber(m[3]) - now}
end

local new_run = 0
if not inc then
  inc = ARGV[5]
  redis.call('SET', KEYS[2], inc)
  m[1] = false
end
if (not m[1]) or m[5] == '1' or (m[4] == '1' and not takeover) then
  -- No run, a finished run, or one that an earlier trainer held: start a new run. The
  -- producers see RUN_CHANGED and join it; frames of the old run are dropped here and,
  -- should any still arrive, by the trainer (the run id is in every frame).
  redis.call('DEL', KEYS[1], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
  redis.call('HSET', KEYS[1], 'version', ARGV[7], 'run', ARGV[4], 'next', 0, 'floor', 0)
  m[1] = ARGV[4]
  new_run = 1
end
redis.call('HSET', KEYS[1], 'claim', ARGV[1], 'claim_deadline', now + tonumber(ARGV[2]),
  'claimed', 1)
local fence = redis.call('HINCRBY', KEYS[1], 'fence', 1)
return {'OK', inc, m[1], new_run, fence}
