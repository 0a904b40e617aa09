-- detach.lua: a single trainer that stops without finishing gives back the frames it
-- popped and did not hand out (at the end pop.lua and BRPOP take from), and marks the run
-- detached at its state's digest (consumer/checkpoint.py), so that a trainer resumed from
-- that state takes the run over as it stands (resume.lua; docs/design.md "Resume").
-- Returns {'OK', frames given back} or {'STATE_LOST'}, {'RUN_CHANGED'}, {'CLAIM_LOST'}
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local data_key = KEYS[3]         -- LIST   the data list
local stats_key = KEYS[4]        -- HASH   queue counters
local incarnation = ARGV[1]
local run = ARGV[2]
local token = ARGV[3]            -- the trainer's claim token
local position = ARGV[4]         -- the digest of its state_dict() now
local final = ARGV[5]            -- '1': the call with the next frame to hand out marks
-- ARGV[6..]: the frames, the last to hand out first (a call gives back a chunk of them,
-- the latest first: a list given back in part is unmarked, so any resume drops it)
local first_frame = 6

if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local m = redis.call('HMGET', meta_key, 'run', 'claim')
if m[1] ~= run then return {'RUN_CHANGED'} end
if m[2] ~= token then return {'CLAIM_LOST'} end
local given = #ARGV - first_frame + 1
for i = first_frame, #ARGV, 1000 do  -- unpack's stack is bounded: pushed 1000 at a time
  redis.call('RPUSH', data_key, unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
-- Popped again, they are counted again: pushed + given_back = popped + listed.
if given > 0 then redis.call('HINCRBY', stats_key, 'given_back', given) end
local marker = run .. ':' .. position
if final == '1' then redis.call('HSET', meta_key, 'detached', marker) end
return {'OK', given}
