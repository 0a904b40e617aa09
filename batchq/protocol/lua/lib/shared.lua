-- lib/shared.lua: prepended to every script (batchq/protocol/calls.py), so that what
-- several scripts do is written once. No KEYS or ARGV here: each script names its own.

-- The server's clock in ms (the clock every deadline in Redis uses; batchq/protocol/layout.py's
-- time_ms is the same arithmetic for the TIME command's reply in Python).
local function server_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The global slot number g of a lease entry '<g>:<token>', or '<g>/<mask>:<token>' in a
-- run of several groups (batchq/protocol/layout.py's entry_slot), as the string it is in
-- the entry; nil for a malformed entry.
local function entry_slot(entry)
  return string.match(entry, '^(%d+)[/:]')
end

-- The part of a lease entry before its token: the work entry that builds its shard again
-- for the same groups ('<g>' or '<g>/<mask>', batchq/protocol/layout.py's work_entry).
local function entry_spec(entry)
  return string.match(entry, '^(%d+/?%d*):')
end

-- Hand every shard of a producer's lease list back to the front of the work list, for
-- the same groups, in the order they were held so that the oldest is redone first, and
-- delete the list. Returns how many went back.
local function hand_back_leases(lease_key, work_key)
  local held = redis.call('LRANGE', lease_key, 0, -1)
  local returned = 0
  for j = #held, 1, -1 do
    local g = entry_spec(held[j])
    if g then
      redis.call('LPUSH', work_key, g)
      returned = returned + 1
    end
  end
  redis.call('DEL', lease_key)
  return returned
end
