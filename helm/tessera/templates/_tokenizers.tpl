{{/*
Where the gateway finds a model's tokenizer. The gateway tokenizes prompts itself, reading tokenizer.json,
tokenizer_config.json and chat_template.jinja from the directory a model's replicas register
(tessera.engine.tokenizer_source): the model or tokenizer path itself, or, for a Hugging Face hub id, its
snapshot in the engines' Hugging Face cache ($HF_HOME/hub/models--<org>--<name>/snapshots/<commit>). The
gateway must read that same path:
- modelStorage.hubCache.existingClaim: the shared cache, mounted read-only in the gateway at the same path;
- no claim (each engine pod caches in its own emptyDir): the gateway pod fetches the tokenizer files of the
  same repositories into an emptyDir at the same path before it starts (tessera.tokenizerFetchContainer).
  Both resolve the repository's default revision; should it move between the gateway's fetch and an engine's
  download, the gateway lacks the engine's snapshot until its pods restart (a shared claim has no such gap).
*/}}

{{/* The hub ids among the models' tokenizer sources (engine.tokenizer, else engine.model), sorted, space-separated. */}}
{{- define "tessera.hubTokenizerIds" -}}
{{- $ids := list }}
{{- range .Values.models }}
{{- $source := toString (default .engine.model .engine.tokenizer) }}
{{- if not (or (hasPrefix "/" $source) (hasPrefix "." $source) (contains "://" $source)) }}
{{- $ids = append $ids $source }}
{{- end }}
{{- end }}
{{- $ids | uniq | sortAlpha | join " " }}
{{- end }}

{{/* Whether the gateway fetches tokenizers itself: a hub-id tokenizer and no shared hub-cache claim. */}}
{{- define "tessera.gatewayFetchesTokenizers" -}}
{{- if and (include "tessera.hubTokenizerIds" .) (not .Values.modelStorage.hubCache.existingClaim) }}true{{ end }}
{{- end }}

{{/* The gateway's init container that fetches the hub-id models' tokenizer files into its cache. */}}
{{- define "tessera.tokenizerFetchContainer" -}}
- name: fetch-tokenizers
  image: {{ include "tessera.image" (list . .Values.image) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - python3
    - -c
    - |
      import sys
      from huggingface_hub import snapshot_download
      # The files the gateway reads (tessera.engine.tokenizer_source.TOKENIZER_FILES).
      files = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
      for repo_id in sys.argv[1:]:
          print(f"fetching the tokenizer of {repo_id}", flush=True)
          print(snapshot_download(repo_id=repo_id, allow_patterns=files), flush=True)
    {{- range include "tessera.hubTokenizerIds" . | splitList " " | compact }}
    - {{ . | quote }}
    {{- end }}
  securityContext:
    {{- include "tessera.containerSecurityContext" (list . true) | nindent 4 }}
  env:
    {{- include "tessera.hubEnv" . | nindent 4 }}
    - name: HOME
      value: /tmp
  resources:
    {{- toYaml .Values.gateway.tokenizerFetch.resources | nindent 4 }}
  # A read-only root: it writes only to the cache and /tmp.
  volumeMounts:
    - name: hf-cache
      mountPath: {{ .Values.modelStorage.hubCache.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
