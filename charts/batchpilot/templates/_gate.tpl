{{/* A model on another engine (models[].engine) behind batchpilot-gate: docs/gate.md. ------- */}}

{{/* The flags the chart gives an engine of a known kind, so that it listens where the gate sends
     requests, answers to the model's name and caps its running requests at the gate's ceiling.
     Call with (list $model $modelName). */}}
{{- define "batchpilot.engine.chartArgs" -}}
{{- $model := index . 0 -}}
{{- $modelName := index . 1 -}}
{{- $engine := $model.engine -}}
{{- $port := int (default 8000 $engine.port) -}}
{{- if eq $engine.kind "vllm" -}}
{{- list "--host=127.0.0.1" (printf "--port=%d" $port) (printf "--served-model-name=%s" $modelName) (printf "--max-num-seqs=%d" (int $engine.maxRunning)) | toJson -}}
{{- else if eq $engine.kind "sglang" -}}
{{- list "--host=127.0.0.1" (printf "--port=%d" $port) (printf "--served-model-name=%s" $modelName) (printf "--max-running-requests=%d" (int $engine.maxRunning)) | toJson -}}
{{- else if eq $engine.kind "llamacpp" -}}
{{- /* llama-server's parser takes no --flag=N: each value is the next arg. --metrics: its llamacpp:* series. */ -}}
{{- list "--host" "127.0.0.1" "--port" (printf "%d" $port) "--alias" $modelName "--parallel" (printf "%d" (int $engine.maxRunning)) "--metrics" | toJson -}}
{{- else -}}
{{- list | toJson -}}
{{- end -}}
{{- end -}}

{{/* Refuses what a gated model cannot do; call with (list $index $model $profile). */}}
{{- define "batchpilot.engine.validate" -}}
{{- $index := index . 0 -}}
{{- $model := index . 1 -}}
{{- $profile := index . 2 -}}
{{- $engine := $model.engine -}}
{{- $where := printf "models[%d].engine" $index -}}
{{- $chartFlags := list -}}
{{- range (include "batchpilot.engine.chartArgs" (list $model "m") | fromJsonArray) -}}
{{- if hasPrefix "-" . -}}
{{- $chartFlags = append $chartFlags (regexReplaceAll "=.*$" . "") -}}
{{- end -}}
{{- end -}}
{{- if eq $engine.kind "llamacpp" -}}
{{- $chartFlags = concat $chartFlags (list "-np" "--alias" "-a") -}}
{{- end -}}
{{- range $engine.args -}}
{{- $flag := regexReplaceAll "=.*$" . "" -}}
{{- if has $flag $chartFlags -}}
{{- fail (printf "%s.args: %s is the chart's for a %s engine (from port, maxRunning and the model name); leave it out" $where $flag $engine.kind) -}}
{{- end -}}
{{- end -}}
{{- if $model.preset -}}
{{- fail (printf "models[%d]: preset picks batchpilot-runtime's random-weight model; a model with engine loads its own (engine.args)" $index) -}}
{{- end -}}
{{- if $profile.window.maxPrefillTokens -}}
{{- fail (printf "models[%d].profile.window.maxPrefillTokens: batchpilot-gate cannot bound prompt tokens per step; set the engine's own flag in %s.args" $index $where) -}}
{{- end -}}
{{- if and $profile.slo $profile.slo.interTokenP99Ms -}}
{{- fail (printf "models[%d].profile.slo.interTokenP99Ms: the objective moves the per-step prompt budget, which batchpilot-gate cannot change" $index) -}}
{{- end -}}
{{- $bounds := dig "tuning" "bounds" "hardCap" dict $profile -}}
{{- if and (hasKey $bounds "max") (gt (int $bounds.max) (int $engine.maxRunning)) -}}
{{- fail (printf "models[%d].profile.tuning.bounds.hardCap.max %d exceeds %s.maxRunning %d, the engine's own cap" $index (int $bounds.max) $where (int $engine.maxRunning)) -}}
{{- end -}}
{{- if gt (int $profile.window.hardCap) (int $engine.maxRunning) -}}
{{- fail (printf "models[%d].profile.window.hardCap %d exceeds %s.maxRunning %d, the engine's own cap" $index (int $profile.window.hardCap) $where (int $engine.maxRunning)) -}}
{{- end -}}
{{- end -}}

{{/* The gate's image: the runtime image's CPU tag unless gate.image names another. */}}
{{- define "batchpilot.gate.image" -}}
{{- $gate := .Values.gate.image -}}
{{- $repository := default .Values.runtime.image.repository $gate.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.runtime.image.tag) $gate.tag -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{/* The engine container and the gate container of a gated model's pod.
     Call with (list $ $model $window $lanes $resources). */}}
{{- define "batchpilot.gate.containers" -}}
{{- $root := index . 0 -}}
{{- $model := index . 1 -}}
{{- $window := index . 2 -}}
{{- $lanes := index . 3 -}}
{{- $resources := index . 4 -}}
{{- $runtime := $root.Values.runtime -}}
{{- $engine := $model.engine -}}
{{- $modelName := default $model.name $model.modelName -}}
{{- $port := int (default 8000 $engine.port) -}}
{{- $command := $engine.command -}}
{{- if and (not $command) (eq $engine.kind "sglang") -}}
{{- $command = list "python3" "-m" "sglang.launch_server" -}}
{{- end -}}
- name: engine
  image: {{ $engine.image | quote }}
  imagePullPolicy: {{ default $runtime.image.pullPolicy $engine.imagePullPolicy }}
  {{- with $command }}
  command:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  args:
    {{- range (include "batchpilot.engine.chartArgs" (list $model $modelName) | fromJsonArray) }}
    - {{ . | quote }}
    {{- end }}
    {{- range $engine.args }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- /* Engines write caches under HOME (Hugging Face, Triton, torch.compile): a volume, as the
           root filesystem is read-only. */}}
    - name: HOME
      value: /cache
    - name: HF_HOME
      value: /cache/huggingface
    - name: XDG_CACHE_HOME
      value: /cache
    {{- with $engine.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- /* Readiness is the gate's (its /readyz asks the engine's /health). Liveness restarts an engine
         whose /health stops answering 200 (vLLM answers 503 once its engine core died); it runs
         in the container because the engine listens on loopback, out of the kubelet's httpGet. */}}
  {{- with (include "batchpilot.gate.engineLiveness" (list $model $port) | fromYaml) }}
  startupProbe:
    {{- toYaml (merge (omit . "periodSeconds" "failureThreshold" "successThreshold" "initialDelaySeconds")
        (dict "periodSeconds" 10 "failureThreshold" (div (add (int (default 1800 $engine.startupSeconds)) 9) 10))) | nindent 4 }}
  livenessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  lifecycle:
    {{- /* SIGTERM reaches both containers at once; the engine must outlive the gate's drain of the
           requests in flight to it (the kubelet's sleep action needs no binary in the image). */}}
    preStop:
      sleep:
        seconds: {{ max 1 (sub (int $runtime.terminationGracePeriodSeconds) 5) }}
  resources:
    {{- toYaml $resources | nindent 4 }}
  securityContext:
    {{- toYaml (default $runtime.securityContext $engine.securityContext) | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: cache
      mountPath: /cache
    - name: shm
      mountPath: /dev/shm
    {{- with $model.checkpoint }}
    - name: checkpoint
      mountPath: /models/{{ $model.name }}
      readOnly: true
      {{- with .subPath }}
      subPath: {{ . }}
      {{- end }}
    {{- end }}
- name: gate
  image: {{ include "batchpilot.gate.image" $root | quote }}
  imagePullPolicy: {{ default $runtime.image.pullPolicy $root.Values.gate.image.pullPolicy }}
  command: ["batchpilot-gate"]
  args:
    - --upstream=http://127.0.0.1:{{ $port }}
    - --model-name={{ $modelName }}
    - --max-hard-cap={{ $engine.maxRunning | int }}
    - --max-model-len={{ default 4096 $engine.maxModelLen | int }}
    - --host=0.0.0.0
    - --port={{ $runtime.ports.http }}
    - --admin-port={{ $runtime.ports.admin }}
    - --admin-token-file=/var/run/batchpilot/admin-token/{{ $root.Values.adminToken.key }}
    - --target-batch-size={{ $window.targetBatchSize | int }}
    - --hard-cap={{ $window.hardCap | int }}
    - --max-wait-ms={{ $window.maxWaitMs | int }}
    - --tail-mark-ratio={{ $window.tailMarkRatio }}
    - --max-queue={{ $root.Values.gate.maxQueue | int }}
    {{- range $lanes }}
    - --lane={{ .name }}:target={{ .window.targetBatchSize | int }},cap={{ .window.hardCap | int }},wait={{ .window.maxWaitMs | int }},tail={{ .window.tailMarkRatio }},reserved={{ default 0 .reservedSlots | int }}
    {{- end }}
    - --drain-timeout-s={{ max 1 (sub (int $runtime.terminationGracePeriodSeconds) 5) }}
    {{- if eq $engine.kind "llamacpp" }}
    {{- /* llama-server listens on loopback and labels nothing: the gate passes its llamacpp:* series
           on, labelled with the model, and is their only scraper (a scrape resets two gauges). */}}
    - --engine-metrics=/metrics
    {{- end }}
  ports:
    - name: http
      containerPort: {{ $runtime.ports.http }}
      protocol: TCP
    - name: admin
      containerPort: {{ $runtime.ports.admin }}
      protocol: TCP
  startupProbe:
    httpGet:
      path: /healthz
      port: http
    periodSeconds: 5
    failureThreshold: 12
  livenessProbe:
    httpGet:
      path: /healthz
      port: http
    periodSeconds: 15
    timeoutSeconds: 5
    failureThreshold: 4
  readinessProbe:
    {{- /* Ready when the engine's /health answers 200: loading a large model takes minutes. */}}
    httpGet:
      path: /readyz
      port: http
    periodSeconds: 5
    timeoutSeconds: 3
    failureThreshold: 2
  resources:
    {{- toYaml $root.Values.gate.resources | nindent 4 }}
  securityContext:
    {{- toYaml $runtime.securityContext | nindent 4 }}
  volumeMounts:
    - name: admin-token
      mountPath: /var/run/batchpilot/admin-token
      readOnly: true
    - name: tmp
      mountPath: /tmp
{{- end -}}

{{/* The engine container's liveness probe as YAML, empty for none: models[].engine.livenessProbe
     verbatim, none when it is false; else for vllm and sglang (whose images ship python3) an exec
     probe that asks the engine's /health on loopback. Call with (list $model $port). */}}
{{- define "batchpilot.gate.engineLiveness" -}}
{{- $model := index . 0 -}}
{{- $port := index . 1 -}}
{{- $engine := $model.engine -}}
{{- if hasKey $engine "livenessProbe" -}}
{{- /* The schema admits a probe or false. */}}
{{- if $engine.livenessProbe -}}
{{- toYaml $engine.livenessProbe -}}
{{- end -}}
{{- else if has $engine.kind (list "vllm" "sglang") -}}
exec:
  command:
    - python3
    - -c
    - {{ printf "import urllib.request; urllib.request.urlopen('http://127.0.0.1:%d/health', timeout=8)" $port | quote }}
periodSeconds: 15
timeoutSeconds: 10
failureThreshold: 4
{{- end -}}
{{- end -}}
