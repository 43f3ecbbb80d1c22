{{/*
Who owns the RayService's serveConfigV2 (issue #14: `helm upgrade` must never drop a Model).

operator.enabled (the default): the operator is the only writer. The chart renders each models[] entry as a
Model object (templates/models.yaml) and leaves serveConfigV2 out of the RayService. Helm's upgrade is a
JSON merge patch from the old manifest to the new one (three-way with the live object, or two-way): a field
that neither manifest has is never in it, so the applications the operator wrote (for values models and kubectl-applied Models alike)
survive every upgrade, also under `helm template | kubectl apply` and GitOps tools, where a `lookup` of the
live object would render empty and drop them.

operator.enabled false: nobody else writes the field, so the chart renders it from the values.
*/}}
{{- define "tessera.chartOwnsServeConfig" -}}
{{- if not .Values.operator.enabled }}true{{ end }}
{{- end }}

{{/*
A models[] entry's engine settings as the engine is given them: pvc:// model, tokenizer and draft-model paths
become the paths where the chart mounts their claims (tessera.modelPath); everything else as written.
Call with (list . <a deep copy of the entry's engine>): it rewrites that dict in place and renders nothing
(include returns only text, and a toYaml/fromYaml round trip would turn large integers into floats).
*/}}
{{- define "tessera.resolveModelPaths" -}}
{{- $root := index . 0 }}
{{- $engine := index . 1 }}
{{- range $key := list "model" "tokenizer" }}
{{- if kindIs "string" (index $engine $key) }}
{{- $_ := set $engine $key (include "tessera.modelPath" (list $root (index $engine $key))) }}
{{- end }}
{{- end }}
{{- if and (kindIs "map" $engine.speculative) (kindIs "string" $engine.speculative.draftModel) }}
{{- $_ := set $engine.speculative "draftModel" (include "tessera.modelPath" (list $root $engine.speculative.draftModel)) }}
{{- end }}
{{- end }}
