{{/*
Autoscaling, both levels (docs/kubernetes.md "Autoscaling"):

- engine replicas: a models[] entry's engine.autoscaling (EngineConfig.autoscaling) becomes Serve's
  autoscaling_config in build_app; such a model has no fixed `replicas`.
- GPU worker pods: rayService.enableInTreeAutoscaling lets KubeRay's in-tree autoscaler (a container KubeRay
  adds to the head pod, configured by rayService.autoscaler) add and remove worker pods as replicas need
  GPUs. It talks to the Kubernetes API as the head pod's service account (tessera.rayAutoscalerServiceAccount,
  templates/ray-autoscaler.yaml); the token is mounted into the autoscaler container only, so the Ray head
  process (which runs whatever a Ray job submits) holds no API credentials.
*/}}

{{/* The head pod's service account while the in-tree autoscaler runs, else "". */}}
{{- define "tessera.rayAutoscalerServiceAccount" -}}
{{- if .Values.rayService.enableInTreeAutoscaling }}
{{- include "tessera.componentName" (list . "ray-autoscaler") }}
{{- end }}
{{- end }}

{{/*
The projected service-account token of the autoscaler container (the standard kube-api-access layout: token,
cluster CA, namespace, at the path Ray's KubeRay node provider reads). A volume of the head pod, mounted only
by the autoscaler container (autoscalerOptions.volumeMounts).
*/}}
{{- define "tessera.rayAutoscalerTokenVolume" -}}
{{- if .Values.rayService.enableInTreeAutoscaling }}
- name: autoscaler-api-token
  projected:
    defaultMode: 0444
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3607
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                fieldPath: metadata.namespace
{{- end }}
{{- end }}

{{/*
RayService rayClusterConfig.autoscalerOptions (KubeRay's fields): a container that meets the restricted Pod
Security Standard (KubeRay's default container sets no securityContext, which the standard refuses).
*/}}
{{- define "tessera.rayAutoscalerOptions" -}}
{{- $autoscaler := .Values.rayService.autoscaler }}
autoscalerOptions:
  version: {{ $autoscaler.version }}
  upscalingMode: {{ $autoscaler.upscalingMode }}
  idleTimeoutSeconds: {{ $autoscaler.idleTimeoutSeconds }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  resources:
    {{- toYaml $autoscaler.resources | nindent 4 }}
  securityContext:
    {{- /* NOTE: the autoscaler writes its logs below /tmp/ray, as Ray does. */}}
    {{- include "tessera.containerSecurityContext" (list . false) | nindent 4 }}
    runAsUser: {{ .Values.podSecurityContext.runAsUser }}
    runAsGroup: {{ .Values.podSecurityContext.runAsGroup }}
  volumeMounts:
    - name: autoscaler-api-token
      mountPath: /var/run/secrets/kubernetes.io/serviceaccount
      readOnly: true
{{- end }}

{{/*
A models[] entry's Serve args besides the engine: the fixed replica count, or nothing when engine.autoscaling
sizes the deployment (build_app refuses both). Call with the entry; renders a dict as JSON.
*/}}
{{- define "tessera.modelReplicaArgs" -}}
{{- if kindIs "map" .engine.autoscaling }}
{{- dict | toJson }}
{{- else }}
{{- dict "replicas" (int (default 1 .replicas)) | toJson }}
{{- end }}
{{- end }}

{{/*
The replicas a model can ever have: engine.autoscaling.maxReplicas, else its fixed count (default 1).
tessera.validateGpus counts GPUs with it.
*/}}
{{- define "tessera.modelMaxReplicas" -}}
{{- if kindIs "map" .engine.autoscaling }}
{{- int .engine.autoscaling.maxReplicas }}
{{- else }}
{{- int (default 1 .replicas) }}
{{- end }}
{{- end }}

{{/*
EngineConfig.autoscaling's rules that the schema cannot express (tests/unit/helm/test_helm_engine_values.py
checks the chart accepts exactly what EngineConfig accepts), and replicas XOR autoscaling.
Defaults (AutoscalingConfig): minReplicas 1, metricsIntervalS 10, lookBackPeriodS 30.
*/}}
{{- define "tessera.validateAutoscaling" -}}
{{- range $i, $m := .Values.models }}
{{- $a := $m.engine.autoscaling }}
{{- if kindIs "map" $a }}
{{- $where := printf "models[%d] (%s)" $i $m.name }}
{{- if and (hasKey $m "replicas") (ne (toString $m.replicas) "<nil>") }}
{{- fail (printf "%s: replicas=%v and engine.autoscaling are mutually exclusive: with autoscaling, Serve owns the replica count; remove replicas (use autoscaling.minReplicas, maxReplicas, initialReplicas)" $where $m.replicas) }}
{{- end }}
{{- $min := int (ternary $a.minReplicas 1 (hasKey $a "minReplicas")) }}
{{- $max := int $a.maxReplicas }}
{{- if gt $min $max }}
{{- fail (printf "%s: engine.autoscaling.minReplicas=%d must be <= maxReplicas=%d" $where $min $max) }}
{{- end }}
{{- if and (hasKey $a "initialReplicas") (ne (toString $a.initialReplicas) "<nil>") }}
{{- $initial := int $a.initialReplicas }}
{{- if or (lt $initial $min) (gt $initial $max) }}
{{- fail (printf "%s: engine.autoscaling.initialReplicas=%d must be within minReplicas=%d and maxReplicas=%d" $where $initial $min $max) }}
{{- end }}
{{- end }}
{{- $interval := float64 (ternary $a.metricsIntervalS 10 (hasKey $a "metricsIntervalS")) }}
{{- $window := float64 (ternary $a.lookBackPeriodS 30 (hasKey $a "lookBackPeriodS")) }}
{{- if ge $interval $window }}
{{- fail (printf "%s: engine.autoscaling.metricsIntervalS=%v must be below lookBackPeriodS=%v (the window would hold at most one report per replica)" $where $interval $window) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
