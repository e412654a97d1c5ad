{{/* Names and labels. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "router"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* A NetworkPolicy peer: the pods of one component of this release. */}}
{{- define "pdserve.peer" -}}
- podSelector:
    matchLabels:
      {{- include "pdserve.selectorLabels" . | nindent 6 }}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" .root }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.flavor) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The gRPC service each role serves (what its probes ask grpc.health.v1 about). */}}
{{- define "pdserve.healthService" -}}
{{- $services := dict "router" "pdserve.v1.GenerationService" "prefill" "pdserve.v1.PrefillService" "decode" "pdserve.v1.DecodeService" -}}
{{- get $services . -}}
{{- end -}}

{{/*
A settings value as pdserve reads it from the environment: booleans as true/false, and
whole numbers without an exponent (Helm hands numbers over as float64, which would print
67108864 as 6.7108864e+07).
*/}}
{{- define "pdserve.envValue" -}}
{{- if kindIs "bool" . -}}
{{- ternary "true" "false" . -}}
{{- else if kindIs "float64" . -}}
{{- if eq . (floor .) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* ConfigMap data lines (indented by 2), PDSERVE_<KEY>: "<value>", from a dict of settings. */}}
{{- define "pdserve.settingsData" -}}
{{- range $key, $value := . }}
  PDSERVE_{{ upper $key }}: {{ include "pdserve.envValue" $value | quote }}
{{- end }}
{{- end -}}

{{/* Merged settings blocks of a role: (dict "root" $ "role" "prefill" "block" "engine"). */}}
{{- define "pdserve.roleSettings" -}}
{{- $shared := get .root.Values .block | default dict -}}
{{- $own := get (get .root.Values .role) .block | default dict -}}
{{- toYaml (mergeOverwrite (deepCopy $shared) (deepCopy $own)) -}}
{{- end -}}

{{/* The KV transport the decode pool uses. */}}
{{- define "pdserve.kvTransport" -}}
{{- $worker := include "pdserve.roleSettings" (dict "root" . "role" "decode" "block" "worker") | fromYaml -}}
{{- $worker.kv_transport | default "grpc" -}}
{{- end -}}

{{/* Redis: host, URL without the password, and the Secret holding the password. */}}
{{- define "pdserve.redisHost" -}}
{{- printf "%s-redis.%s.svc" (include "pdserve.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* The Secret holding Redis's password: given, generated (in-chart Redis), or none. */}}
{{- define "pdserve.redisPasswordSecret" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.auth.enabled -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "pdserve.fullname" .)) -}}
{{- end -}}
{{- else -}}
{{- .Values.externalRedis.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisPasswordKey" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.auth.passwordKey -}}
{{- else -}}
{{- .Values.externalRedis.passwordKey -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisUrl" -}}
{{- $url := "" -}}
{{- if .Values.redis.enabled -}}
{{- $url = printf "redis://%s:%d/%d" (include "pdserve.redisHost" .) (int .Values.redis.port) (int .Values.redis.database) -}}
{{- else -}}
{{- $url = required "externalRedis.url is required when redis.enabled is false (e.g. redis://redis.example:6379/0)" .Values.externalRedis.url -}}
{{- if contains "@" $url -}}
{{- fail "externalRedis.url must not carry credentials: put the password in a Secret and name it in externalRedis.existingSecret" -}}
{{- end -}}
{{- end -}}
{{- if include "pdserve.redisPasswordSecret" . -}}
{{- $scheme := regexFind "^rediss?://" $url -}}
{{- printf "%s:$(REDIS_PASSWORD)@%s" $scheme (trimPrefix $scheme $url) -}}
{{- else -}}
{{- $url -}}
{{- end -}}
{{- end -}}

{{/*
Environment every pdserve container gets besides its ConfigMap: the Redis URL (with the
password from its Secret, expanded by the kubelet) and the extra variables.
*/}}
{{- define "pdserve.redisEnv" -}}
{{- $secret := include "pdserve.redisPasswordSecret" . -}}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "pdserve.redisPasswordKey" . }}
{{- end }}
- name: PDSERVE_REDIS_URL
  value: {{ include "pdserve.redisUrl" . | quote }}
{{- end -}}

{{/* Scratch volumes for the read-only root filesystem, and the model volume. */}}
{{- define "pdserve.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.scratch.cacheSizeLimit }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.scratch.shmSizeLimit }}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- end }}
{{- end -}}

{{- define "pdserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/pdserve/.cache
- name: shm
  mountPath: /dev/shm
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
  {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Checks that span several values (the schema checks each value on its own). */}}
{{- define "pdserve.validate" -}}
{{- if and (ne .Values.model.source "image") (not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) .Values.model.path)) -}}
{{- fail (printf "model.path (%s) must lie under model.mountPath (%s) when model.source is %s" .Values.model.path .Values.model.mountPath .Values.model.source) -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $engine := include "pdserve.roleSettings" (dict "root" $ "role" $role "block" "engine") | fromYaml -}}
{{- $batched := $engine.max_num_batched_tokens | default 0 | int -}}
{{- if and $batched (lt $batched (int ($engine.max_num_seqs | default 64))) -}}
{{- fail (printf "%s: engine max_num_batched_tokens (%d) must be >= max_num_seqs (%d)" $role $batched (int ($engine.max_num_seqs | default 64))) -}}
{{- end -}}
{{- end -}}
{{- range $role := list "router" "prefill" "decode" -}}
{{- $cfg := get $.Values $role -}}
{{- $server := include "pdserve.roleSettings" (dict "root" $ "role" $role "block" "server") | fromYaml -}}
{{- if and (hasKey $server "grace_s") (ge (float64 $server.grace_s) (float64 $cfg.terminationGracePeriodSeconds)) -}}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must exceed server grace_s (%v): the pod would be killed mid-drain" $role $cfg.terminationGracePeriodSeconds $server.grace_s) -}}
{{- end -}}
{{- if and $cfg.autoscaling.enabled (gt (int $cfg.autoscaling.minReplicas) (int $cfg.autoscaling.maxReplicas)) -}}
{{- fail (printf "%s.autoscaling.minReplicas (%v) exceeds maxReplicas (%v)" $role $cfg.autoscaling.minReplicas $cfg.autoscaling.maxReplicas) -}}
{{- end -}}
{{- end -}}
{{- range $role := list "router" "prefill" "decode" -}}
{{- $seen := dict -}}
{{- range $name, $port := (get $.Values $role).ports -}}
{{- $key := toString (int $port) -}}
{{- if hasKey $seen $key -}}
{{- fail (printf "%s.ports: %s and %s are both %s" $role (get $seen $key) $name $key) -}}
{{- end -}}
{{- $_ := set $seen $key $name -}}
{{- end -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $tp := int (get $.Values $role).tensorParallelSize -}}
{{- if and (eq $role "decode") (eq $.Values.image.flavor "cuda") (ne $tp (int $.Values.prefill.tensorParallelSize)) -}}
{{- fail (printf "prefill.tensorParallelSize %d and decode.tensorParallelSize %d: on GPU images prefill and decode need one size for now (KV moves between different sizes on CPU caches; GPU cache layouts are not checked yet)" (int $.Values.prefill.tensorParallelSize) $tp) -}}
{{- end -}}
{{- if eq $role "decode" -}}
{{- /* Each decode rank runs its own KV receiver, on ports.kv + its rank. */ -}}
{{- $kv := int $.Values.decode.ports.kv -}}
{{- range $name, $port := $.Values.decode.ports -}}
{{- if and (ne $name "kv") (ge (int $port) $kv) (lt (int $port) (add $kv $tp)) -}}
{{- fail (printf "decode.ports.%s (%d) falls among the KV ports of the decode ranks (%d-%d: ports.kv + rank, tensorParallelSize %d): move one of them" $name (int $port) $kv (sub (add $kv $tp) 1) $tp) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $gpus := index ((get $.Values $role).resources.limits | default dict) "nvidia.com/gpu" -}}
{{- $want := mul $tp (ternary (int (get $.Values.kuberay.actorsPerPod $role)) 1 $.Values.kuberay.enabled) -}}
{{- if and $gpus (ne (int $gpus) (int $want)) -}}
{{- fail (printf "%s.resources.limits nvidia.com/gpu (%v) must be %d: one GPU per tensor-parallel rank (tensorParallelSize %d%s); leave it out and the chart sets it" $role $gpus $want $tp (ternary " times kuberay.actorsPerPod" "" $.Values.kuberay.enabled)) -}}
{{- end -}}
{{- end -}}
{{- include "pdserve.validateSecurity" . -}}
{{- if .Values.kuberay.enabled -}}
{{- range $role := list "router" "prefill" "decode" -}}
{{- if get $.Values.config $role -}}
{{- fail (printf "kuberay.enabled: config.%s is not used (one `pdserve up` configures every service): put these settings in config.launcher" $role) -}}
{{- end -}}
{{- end -}}
{{- else if .Values.config.launcher -}}
{{- fail "config.launcher is used with kuberay.enabled only: put these settings in config.router, config.prefill or config.decode" -}}
{{- end -}}
{{- if .Values.kuberay.enabled -}}
{{- if .Values.router.server -}}
{{- fail "kuberay.enabled: router.server is not used (one `pdserve up` configures every service): put these settings in the shared server block" -}}
{{- end -}}
{{- if .Values.router.autoscaling.enabled -}}
{{- fail "kuberay.enabled: router.autoscaling does not apply (set kuberay.launcher.routers)" -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- range $block := list "engine" "worker" "server" -}}
{{- if get (get $.Values $role) $block -}}
{{- fail (printf "kuberay.enabled: %s.%s is not used (one `pdserve up` configures both pools): put these settings in the shared %s block" $role $block $block) -}}
{{- end -}}
{{- end -}}
{{- if (get $.Values $role).autoscaling.enabled -}}
{{- fail (printf "kuberay.enabled: %s.autoscaling does not apply (the launcher holds the pool sizes: `pdserve scale`)" $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The PDSERVE_* settings of one role's ConfigMap: (dict "root" $ "role" "prefill"); role is
router, prefill, decode or launcher (KubeRay mode: `pdserve up`). Each workload carries
a checksum of its own role's data, so a change restarts only the pods it concerns.
*/}}
{{- define "pdserve.configData" -}}
{{- $v := .root.Values -}}
{{- if eq .role "router" }}
  PDSERVE_HOST: "0.0.0.0"
  PDSERVE_PORT: {{ $v.router.ports.grpc | int | quote }}
  PDSERVE_HTTP_PORT: {{ $v.router.ports.http | int | quote }}
  PDSERVE_METRICS_PORT: {{ $v.router.ports.metrics | int | quote }}
  PDSERVE_HEALTH_PORT: {{ $v.router.ports.health | int | quote }}
  PDSERVE_ROUTER_MODEL: {{ $v.model.path | quote }}
  {{- include "pdserve.securityData" . }}
  {{- include "pdserve.settingsData" (include "pdserve.roleSettings" (dict "root" .root "role" "router" "block" "server") | fromYaml) }}
  {{- include "pdserve.settingsData" $v.router.settings }}
{{- else if eq .role "launcher" }}
  # `pdserve up`: pool sizes (one actor per pdserve_<role> resource of the worker groups)
  PDSERVE_PREFILL: {{ mul (int $v.prefill.replicas) (int $v.kuberay.actorsPerPod.prefill) | quote }}
  PDSERVE_DECODE: {{ mul (int $v.decode.replicas) (int $v.kuberay.actorsPerPod.decode) | quote }}
  {{- include "pdserve.settingsData" $v.kuberay.launcher }}
  # the router actors (the first one listens on these ports in the head pod)
  PDSERVE_HOST: "0.0.0.0"
  PDSERVE_PORT: {{ $v.router.ports.grpc | int | quote }}
  PDSERVE_HTTP_PORT: {{ $v.router.ports.http | int | quote }}
  PDSERVE_METRICS_PORT: {{ $v.router.ports.metrics | int | quote }}
  PDSERVE_HEALTH_PORT: {{ $v.router.ports.health | int | quote }}
  PDSERVE_ROUTER_MODEL: {{ $v.model.path | quote }}
  # credentials: the same paths in every Ray pod, each pod holding its own role's files
  {{- include "pdserve.securityData" . }}
  {{- include "pdserve.settingsData" $v.router.settings }}
  # the workers
  PDSERVE_MODEL: {{ $v.model.path | quote }}
  PDSERVE_PREFILL_TP: {{ $v.prefill.tensorParallelSize | int | quote }}
  PDSERVE_DECODE_TP: {{ $v.decode.tensorParallelSize | int | quote }}
  PDSERVE_KV_HOST: "0.0.0.0"
  {{- if eq (int $v.kuberay.actorsPerPod.decode) 1 }}
  PDSERVE_KV_PORT: {{ $v.decode.ports.kv | int | quote }}
  {{- else }}
  # several decode actors per pod: each takes a free KV port
  PDSERVE_KV_PORT: "0"
  {{- end }}
  {{- range $block := list "server" "engine" "worker" }}
  {{- include "pdserve.settingsData" (get $v $block) }}
  {{- end }}
{{- else }}
{{- $cfg := get $v .role }}
  PDSERVE_HOST: "0.0.0.0"
  PDSERVE_PORT: {{ $cfg.ports.grpc | int | quote }}
  PDSERVE_METRICS_PORT: {{ $cfg.ports.metrics | int | quote }}
  PDSERVE_HEALTH_PORT: {{ $cfg.ports.health | int | quote }}
  PDSERVE_MODEL: {{ $v.model.path | quote }}
  PDSERVE_TENSOR_PARALLEL_SIZE: {{ $cfg.tensorParallelSize | int | quote }}
  {{- include "pdserve.securityData" . }}
  {{- if eq .role "decode" }}
  PDSERVE_KV_HOST: "0.0.0.0"
  PDSERVE_KV_PORT: {{ $cfg.ports.kv | int | quote }}
  {{- end }}
  {{- range $block := list "server" "engine" "worker" }}
  {{- include "pdserve.settingsData" (include "pdserve.roleSettings" (dict "root" $.root "role" $.role "block" $block) | fromYaml) }}
  {{- end }}
{{- end }}
{{- end -}}

{{/*
The settings file of one role (`pdserve <role> --config`): values.config.<role>, sections
and keys as pdserve's settings files take them (docs/configuration.md). The variables of
the role's ConfigMap and env win over it. (dict "root" $ "role" "prefill")
*/}}
{{- define "pdserve.configFileDir" -}}/etc/pdserve/config{{- end -}}
{{- define "pdserve.configFile" -}}{{ include "pdserve.configFileDir" . }}/pdserve.yaml{{- end -}}

{{- define "pdserve.configFileData" -}}
{{- $file := get .root.Values.config .role | default dict -}}
{{- if $file }}
{{- toYaml $file }}
{{- else -}}
{}
{{- end }}
{{- end -}}

{{/* The ConfigMap checksum of a role: its variables and its settings file. */}}
{{- define "pdserve.configChecksum" -}}
{{- printf "%s\n%s" (include "pdserve.configData" .) (include "pdserve.configFileData" .) | sha256sum -}}
{{- end -}}

{{- define "pdserve.configFileVolume" -}}
- name: pdserve-config
  configMap:
    name: {{ include "pdserve.fullname" .root }}-{{ .role }}-file
{{- end -}}

{{- define "pdserve.configFileMount" -}}
- name: pdserve-config
  mountPath: {{ include "pdserve.configFileDir" . }}
  readOnly: true
{{- end -}}

{{/*
A worker pod's resources: the role's `resources`, and on GPU images one nvidia.com/gpu
per tensor-parallel rank of each worker in the pod (pdserve.validate refuses a different
count given by hand). (dict "root" $ "role" "prefill" "workers" 1)
*/}}
{{- define "pdserve.workerResources" -}}
{{- $cfg := get .root.Values .role -}}
{{- $res := deepCopy $cfg.resources -}}
{{- if eq .root.Values.image.flavor "cuda" -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits "nvidia.com/gpu" (mul (int $cfg.tensorParallelSize) (int .workers)) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}
