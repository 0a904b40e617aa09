-- resume.lua: a trainer restarts the plan from its ledger (a checkpoint, or what it had
-- received when Redis lost the queue's state). A new run id makes every producer join
-- again and drop what it was building; the stale contents of the queue go.
-- KEYS[1] meta  KEYS[2] incarnation  KEYS[3] data  KEYS[4] work  KEYS[5] failures
-- KEYS[6] ledger  KEYS[7] wake
-- ARGV[1] claim token  ARGV[2] new run id  ARGV[3] first global shard to mint (e * S)
-- ARGV[4] fingerprint  ARGV[5] hwm ('' to let the first producer set it)
-- ARGV[6] S  ARGV[7] window  ARGV[8] batches per epoch
-- ARGV[9..] ledger pairs: '<epoch>:<shard>', 'd' or batches already had
-- Returns {'OK', run} or {'CLAIM_LOST'}
local m = redis.call('HMGET', KEYS[1], 'claim', 'run')
if m[1] ~= ARGV[1] then return {'CLAIM_LOST'} end
-- A retried resume whose first reply was lost: producers may have pushed frames of the
-- new run already; doing it again would drop them.
if m[2] == ARGV[2] then return {'OK', ARGV[2]} end
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('HDEL', KEYS[1], 'finished', 'finished_at', 'hwm', 'shards', 'window',
  'epoch_batches')
redis.call('HSET', KEYS[1], 'run', ARGV[2], 'next', ARGV[3], 'floor', ARGV[3],
  'fingerprint', ARGV[4])
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'hwm', ARGV[5], 'shards', ARGV[6], 'window', ARGV[7],
    'epoch_batches', ARGV[8])
end
for i = 9, #ARGV, 2 do
  redis.call('HSET', KEYS[6], ARGV[i], ARGV[i + 1])
end
redis.call('LPUSH', KEYS[7], '1')
redis.call('LTRIM', KEYS[7], 0, 7)
return {'OK', ARGV[2]}
