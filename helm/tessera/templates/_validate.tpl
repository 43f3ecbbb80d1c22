{{/*
Checks values.schema.json cannot express. The schema (generated from EngineConfig) already rejects unknown
keys, wrong types, enums and ranges, and a draft-model method without a draft model; these are the
remaining EngineConfig validators and the chart's own cross-field rules. Each message names the field.
tests/unit/helm/test_helm_engine_values.py checks that the chart accepts exactly what EngineConfig accepts.
tests/unit/helm/test_helm_engine_pods.py checks the engine pods' rules (GPUs, model sources, /dev/shm, extra
env and volumes).
*/}}
{{- define "tessera.validate" -}}
{{- $names := list }}
{{- range $i, $m := .Values.models }}
{{- $where := printf "models[%d] (%s)" $i $m.name }}
{{- if has $m.name $names }}
{{- fail (printf "%s: the model name %q is used twice; application names must be unique" $where $m.name) }}
{{- end }}
{{- $names = append $names $m.name }}
{{- $e := $m.engine }}
{{- /* EngineConfig defaults: tensor_parallel_size=1, block_size=32, max_model_len=2048. */}}
{{- $tp := int (default 1 $e.tensorParallelSize) }}
{{- if gt $tp (int $.Values.rayService.engineWorkers.gpusPerPod) }}
{{- fail (printf "%s: engine.tensorParallelSize=%d does not fit rayService.engineWorkers.gpusPerPod=%d (a replica's GPUs must be on one pod)" $where $tp (int $.Values.rayService.engineWorkers.gpusPerPod)) }}
{{- end }}
{{- with $e.speculative }}
{{- /* SpeculativeConfig defaults: prompt_lookup_min=2, prompt_lookup_max=4. */}}
{{- $lo := int (ternary .promptLookupMin 2 (hasKey . "promptLookupMin")) }}
{{- $hi := int (ternary .promptLookupMax 4 (hasKey . "promptLookupMax")) }}
{{- if gt $lo $hi }}
{{- fail (printf "%s: engine.speculative.promptLookupMin=%d must be <= promptLookupMax=%d" $where $lo $hi) }}
{{- end }}
{{- end }}
{{- if and (hasKey $e "numGpuBlocksOverride") (ne (toString $e.numGpuBlocksOverride) "<nil>") }}
{{- $blocks := int64 $e.numGpuBlocksOverride }}
{{- $blockSize := int64 (ternary $e.blockSize 32 (hasKey $e "blockSize")) }}
{{- $maxLen := int64 (ternary $e.maxModelLen 2048 (hasKey $e "maxModelLen")) }}
{{- if gt $maxLen (mul $blocks $blockSize) }}
{{- fail (printf "%s: engine.maxModelLen=%d exceeds the KV capacity of numGpuBlocksOverride=%d x blockSize=%d = %d tokens" $where $maxLen $blocks $blockSize (mul $blocks $blockSize)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $ports := .Values.rayService.engineWorkers.replicaPorts }}
{{- if lt (int $ports.end) (add (int $ports.start) (int .Values.rayService.engineWorkers.gpusPerPod) -1) }}
{{- fail (printf "rayService.engineWorkers.replicaPorts: %d-%d has fewer ports than gpusPerPod=%d replicas" (int $ports.start) (int $ports.end) (int .Values.rayService.engineWorkers.gpusPerPod)) }}
{{- end }}
{{- $kv := .Values.kvcontrol.kvEventsPorts }}
{{- if lt (int $kv.end) (int $kv.start) }}
{{- fail (printf "kvcontrol.kvEventsPorts: end=%d is below start=%d" (int $kv.end) (int $kv.start)) }}
{{- end }}
{{- $w := .Values.rayService.engineWorkers }}
{{- if or (lt (int $w.replicas) (int $w.minReplicas)) (gt (int $w.replicas) (int $w.maxReplicas)) }}
{{- fail (printf "rayService.engineWorkers: replicas=%d must be within minReplicas=%d and maxReplicas=%d" (int $w.replicas) (int $w.minReplicas) (int $w.maxReplicas)) }}
{{- end }}
{{- if and .Values.gateway.autoscaling.enabled (gt (int .Values.gateway.autoscaling.minReplicas) (int .Values.gateway.autoscaling.maxReplicas)) }}
{{- fail "gateway.autoscaling.minReplicas must be <= gateway.autoscaling.maxReplicas" }}
{{- end }}
{{- if and (eq .Values.rayService.upgradeStrategy.type "NewClusterWithIncrementalUpgrade") (not .Values.rayService.enableInTreeAutoscaling) }}
{{- fail "rayService.upgradeStrategy.type=NewClusterWithIncrementalUpgrade needs rayService.enableInTreeAutoscaling: true (KubeRay refuses it otherwise)" }}
{{- end }}
{{- include "tessera.validateAutoscaling" . }}
{{- include "tessera.validateGpus" . }}
{{- include "tessera.validateModelSources" . }}
{{- include "tessera.validateShm" . }}
{{- include "tessera.validateEngineScrape" . }}
{{- include "tessera.validatePodExtras" (dict "where" "rayService.head" "pod" .Values.rayService.head "env" (include "tessera.env" .) "volumes" (include "tessera.rayHeadVolumes" .) "mounts" (include "tessera.rayHeadMounts" .)) }}
{{- include "tessera.validatePodExtras" (dict "where" "rayService.engineWorkers" "pod" .Values.rayService.engineWorkers "env" (include "tessera.engineWorkerEnv" .) "volumes" (include "tessera.engineWorkerVolumes" .) "mounts" (include "tessera.engineWorkerMounts" .)) }}
{{- range $i, $env := .Values.modelStorage.fetch.env }}
{{- if has $env.name (include "tessera.names" (include "tessera.hubEnv" $) | splitList " ") }}
{{- fail (printf "modelStorage.fetch.env[%d]: %s is set by the chart (HF_HOME: modelStorage.hubCache.mountPath; HF_TOKEN: hfTokenSecret)" $i $env.name) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
GPUs: the models' replicas (an autoscaled model's maxReplicas) x tensorParallelSize must fit in the GPUs the
worker group can ever have:
maxReplicas x gpusPerPod with the in-tree autoscaler, replicas x gpusPerPod without it (KubeRay then keeps
exactly `replicas` pods). A replica's GPUs are on one pod, so a model also cannot have more replicas than
pods x floor(gpusPerPod / tensorParallelSize). Replicas that do not fit would stay pending forever.
Models with engine.accelerator "cpu" need no GPU.
Model objects managed by the operator add to this; the chart cannot see them.
*/}}
{{- define "tessera.validateGpus" -}}
{{- $w := .Values.rayService.engineWorkers }}
{{- $gpusPerPod := int $w.gpusPerPod }}
{{- $pods := ternary (int $w.maxReplicas) (int $w.replicas) .Values.rayService.enableInTreeAutoscaling }}
{{- $podsWhy := ternary (printf "maxReplicas=%d pods" $pods) (printf "replicas=%d pods (enableInTreeAutoscaling is false, so the group keeps that many)" $pods) .Values.rayService.enableInTreeAutoscaling }}
{{- $needed := 0 }}
{{- $parts := list }}
{{- range $i, $m := .Values.models }}
{{- /* engine.accelerator "cpu" asks Ray for no GPU; "auto" is "gpu" with the serving image's CUDA vLLM. */}}
{{- if ne (toString (default "auto" $m.engine.accelerator)) "cpu" }}
{{- $tp := int (default 1 $m.engine.tensorParallelSize) }}
{{- $replicas := int (include "tessera.modelMaxReplicas" $m) }}
{{- $replicasField := ternary "engine.autoscaling.maxReplicas" "replicas" (kindIs "map" $m.engine.autoscaling) }}
{{- $needed = add $needed (mul $replicas $tp) }}
{{- $parts = append $parts (printf "%s: %d%s x %d" $m.name $replicas (ternary " (engine.autoscaling.maxReplicas)" "" (kindIs "map" $m.engine.autoscaling)) $tp) }}
{{- $perPod := div $gpusPerPod $tp }}
{{- if and (gt $perPod 0) (gt $replicas (mul $pods $perPod)) }}
{{- fail (printf "models[%d] (%s): %s=%d do not fit: a pod of gpusPerPod=%d GPUs holds %d replica(s) of tensorParallelSize=%d, and rayService.engineWorkers can have %s" $i $m.name $replicasField $replicas $gpusPerPod $perPod $tp $podsWhy) }}
{{- end }}
{{- end }}
{{- end }}
{{- if gt $needed (mul $pods $gpusPerPod) }}
{{- fail (printf "the models need %d GPUs (replicas x tensorParallelSize: %s) but rayService.engineWorkers can have at most %d: %s x gpusPerPod=%d" $needed (join ", " $parts) (mul $pods $gpusPerPod) $podsWhy $gpusPerPod) }}
{{- end }}
{{- end }}

{{/* pvc:// model paths, the Hugging Face token Secret, the hub cache and the fetch init container. */}}
{{- define "tessera.validateModelSources" -}}
{{- range include "tessera.modelPaths" . | fromJsonArray }}
{{- if hasPrefix "pvc://" .path }}
{{- $claim := include "tessera.pvcClaim" .path }}
{{- if not $claim }}
{{- fail (printf "%s=%q names no claim: write pvc://<claim>/<path>, e.g. pvc://model-weights/llama-3-8b" .where .path) }}
{{- end }}
{{- if not (and (le (len $claim) 253) (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" $claim)) }}
{{- fail (printf "%s=%q: %q is not a PersistentVolumeClaim name (lowercase letters, digits, '-' and '.')" .where .path $claim) }}
{{- end }}
{{- end }}
{{- end }}
{{- $token := .Values.hfTokenSecret }}
{{- if and $token.name (not $token.key) }}
{{- fail (printf "hfTokenSecret.key is required when hfTokenSecret.name is set: the key of the token inside Secret %q" $token.name) }}
{{- end }}
{{- if and $token.key (not $token.name) }}
{{- fail (printf "hfTokenSecret.key=%q is set but hfTokenSecret.name is empty: name the Secret that holds the token" $token.key) }}
{{- end }}
{{- with .Values.modelStorage.hubCache.sizeLimit }}
{{- if not (include "tessera.quantityBytes" .) }}
{{- fail (printf "modelStorage.hubCache.sizeLimit=%q is not a Kubernetes quantity (e.g. 200Gi)" (toString .)) }}
{{- end }}
{{- end }}
{{- $fetch := .Values.modelStorage.fetch }}
{{- if and $fetch.enabled (not $fetch.command) (not (include "tessera.hubModelIds" .)) }}
{{- fail "modelStorage.fetch is enabled with no command, and no model is a hub id to download: set modelStorage.fetch.command, or turn fetch off" }}
{{- end }}
{{- end }}

{{/* /dev/shm: a quantity, not tiny, and below the memory limit that its pages count against. */}}
{{- define "tessera.validateShm" -}}
{{- $w := .Values.rayService.engineWorkers }}
{{- $shm := include "tessera.quantityBytes" $w.shmSizeLimit }}
{{- if not $shm }}
{{- fail (printf "rayService.engineWorkers.shmSizeLimit=%q is not a Kubernetes quantity: write e.g. 16Gi (binary units Ki, Mi, Gi, Ti; decimal k, M, G, T)" (toString $w.shmSizeLimit)) }}
{{- end }}
{{- if lt (int64 $shm) 67108864 }}
{{- fail (printf "rayService.engineWorkers.shmSizeLimit=%s is below 64Mi (a bare number is bytes): NCCL and vLLM's tensor-parallel workers need gigabytes, e.g. 16Gi" (include "tessera.quantityText" $w.shmSizeLimit)) }}
{{- end }}
{{- with (($w.resources).limits).memory }}
{{- $limit := include "tessera.quantityBytes" . }}
{{- if and $limit (ge (int64 $shm) (int64 $limit)) }}
{{- fail (printf "rayService.engineWorkers.shmSizeLimit=%s must be below resources.limits.memory=%s: /dev/shm is memory-backed and its pages count against the container's memory limit" (include "tessera.quantityText" $w.shmSizeLimit) (include "tessera.quantityText" .)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Bytes of a Kubernetes quantity (a string or a number), or "" when it is not one. */}}
{{- define "tessera.quantityBytes" -}}
{{- if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) }}
{{- int64 . }}
{{- else if regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$" (toString .) }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" . }}
{{- $factors := dict "" 1 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "Ei" 1152921504606846976 }}
{{- mulf (float64 $number) (get $factors (trimPrefix $number .)) | int64 }}
{{- end }}
{{- end }}

{{/* The names in a YAML list of named objects (env, volumes), space-separated. */}}
{{- define "tessera.names" -}}
{{- $names := list }}
{{- range fromYamlArray . }}
{{- $names = append $names .name }}
{{- end }}
{{- join " " $names }}
{{- end }}

{{/*
A Ray group's extra env, volumes and mounts against what the chart renders for that pod. Call with
(dict "where" "rayService.head" "pod" <its values> "env" <chart env YAML> "volumes" <chart volumes YAML>
"mounts" <chart mounts YAML>).
*/}}
{{- define "tessera.validatePodExtras" -}}
{{- $where := .where }}
{{- $chartEnv := include "tessera.names" .env | splitList " " }}
{{- $hints := dict "HF_TOKEN" " (use hfTokenSecret)" "HF_HOME" " (use modelStorage.hubCache.mountPath)" }}
{{- range $i, $env := .pod.env }}
{{- if has $env.name $chartEnv }}
{{- fail (printf "%s.env[%d]: %s is set by the chart%s" $where $i $env.name (get $hints $env.name)) }}
{{- end }}
{{- end }}
{{- $chartVolumes := include "tessera.names" .volumes | splitList " " }}
{{- $volumes := $chartVolumes }}
{{- range $i, $volume := .pod.extraVolumes }}
{{- if has $volume.name $chartVolumes }}
{{- fail (printf "%s.extraVolumes[%d]: the volume name %q is the chart's (it uses %s)" $where $i $volume.name (join ", " $chartVolumes)) }}
{{- end }}
{{- if has $volume.name $volumes }}
{{- fail (printf "%s.extraVolumes[%d]: the volume name %q is used twice" $where $i $volume.name) }}
{{- end }}
{{- $volumes = append $volumes $volume.name }}
{{- end }}
{{- $paths := dict }}
{{- range .mounts | fromYamlArray }}
{{- if hasKey $paths .mountPath }}
{{- fail (printf "%s: the chart mounts two volumes at %s (%s and %s); change modelStorage.mountPath, pvcMountRoot or hubCache.mountPath" $where .mountPath (get $paths .mountPath) .name) }}
{{- end }}
{{- $_ := set $paths .mountPath (printf "the chart's %s volume" .name) }}
{{- end }}
{{- range $i, $mount := .pod.extraVolumeMounts }}
{{- if not (has $mount.name $volumes) }}
{{- fail (printf "%s.extraVolumeMounts[%d]: volume %q is not in %s.extraVolumes (nor one of the chart's: %s)" $where $i $mount.name $where (join ", " $chartVolumes)) }}
{{- end }}
{{- if hasKey $paths $mount.mountPath }}
{{- fail (printf "%s.extraVolumeMounts[%d]: %s is already the mount path of %s" $where $i $mount.mountPath (get $paths $mount.mountPath)) }}
{{- end }}
{{- $_ := set $paths $mount.mountPath (printf "%s.extraVolumeMounts[%d]" $where $i) }}
{{- end }}
{{- end }}

{{/*
metrics.engineScrapeConfig: Prometheus finds the replicas through the operator, and reaches them on the
replica ports, which also serve /generate without authentication: those open to named scrapers only.
*/}}
{{- define "tessera.validateEngineScrape" -}}
{{- if .Values.metrics.engineScrapeConfig.enabled }}
{{- if not .Values.operator.enabled }}
{{- fail "metrics.engineScrapeConfig needs operator.enabled: the operator serves Prometheus the engine replicas' addresses (GET /engine-targets)" }}
{{- end }}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.metricsFrom) }}
{{- fail "metrics.engineScrapeConfig with networkPolicy.enabled needs networkPolicy.metricsFrom (e.g. your Prometheus' namespace): the NetworkPolicy opens the engine replica ports, which also serve /generate without authentication, to those peers only, never to every pod" }}
{{- end }}
{{- end }}
{{- end }}
