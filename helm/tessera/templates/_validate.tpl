{{/*
Checks values.schema.json cannot express. The schema (generated from EngineConfig) already rejects unknown
keys, wrong types, enums and ranges, and a draft-model method without a draft model; these are the
remaining EngineConfig validators and the chart's own cross-field rules. Each message names the field.
tests/unit/helm/test_engine_values.py checks that the chart accepts exactly what EngineConfig accepts.
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
{{- end }}
