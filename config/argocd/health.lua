-- Argo CD health check of a RedPacketActivity or a RedPacketBudget (redpacket.io),
-- read from its status (a budget has no phase: its Ready and Stalled decide).
-- make chart copies it into argocd-cm-patch.yaml under both kinds' keys;
-- docs/monitoring.md says how to install it. test/packaging runs it in gopher-lua,
-- the Lua that Argo CD embeds, against status objects of real activities and of
-- budgets.
--
--   Degraded     it needs a person: Stalled is True (DataLost, RedisRolledBack), the
--                phase is Failed, Ready is False for an error (Redis unreachable or
--                misconfigured, a spec Redis disagrees with, the workload refused or
--                not adopted), or settlement parked deliveries (DeadLetters)
--   Suspended    spec.paused: grabbing is stopped on purpose, nothing is lost
--   Healthy      Ready is True: scheduled or open with a grab replica answering, or
--                finished (Exhausted, Expired)
--   Progressing  anything else: no status yet, a spec change not acted on yet,
--                seeding, waiting for a grab replica, deletion waiting for settlement
local hs = { status = "Progressing", message = "waiting for the controller to report status" }
if obj.status == nil then
  return hs
end

local function condition(conditionType)
  if obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == conditionType then
      return c
    end
  end
  return nil
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  local text = c.reason or ""
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

-- Reasons of Ready False that no amount of waiting fixes without a person.
local degradedReasons = {
  DataLost = true,
  RedisRolledBack = true,
  InvalidSpec = true,
  SpecMismatch = true,
  RedisConfigInvalid = true,
  RedisUnavailable = true,
  SeedFailed = true,
  WorkloadFailed = true,
}

local phase = obj.status.phase or ""
local ready = condition("Ready")
local stalled = condition("Stalled")
local settled = condition("Settled")
local grab = condition("GrabServiceAvailable")

if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled, "stalled")
  return hs
end
if phase == "Failed" then
  hs.status = "Degraded"
  hs.message = describe(ready, "the activity is Failed")
  return hs
end
if ready ~= nil and ready.status ~= "True" and degradedReasons[ready.reason] then
  hs.status = "Degraded"
  hs.message = describe(ready, "")
  return hs
end
if grab ~= nil and grab.status == "False" and grab.reason == "NotAdopted" then
  hs.status = "Degraded"
  hs.message = describe(grab, "")
  return hs
end
if settled ~= nil and settled.status == "False" and settled.reason == "DeadLetters" then
  hs.status = "Degraded"
  hs.message = describe(settled, "")
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.message = "the controller has not acted on generation " .. tostring(generation) .. " yet"
  if ready ~= nil then
    hs.message = hs.message .. " (" .. describe(ready, "") .. ")"
  end
  return hs
end

if phase == "Paused" then
  hs.status = "Suspended"
  hs.message = describe(ready, "grabbing is paused (spec.paused)")
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready, "")
  return hs
end
hs.message = describe(ready, hs.message)
return hs
