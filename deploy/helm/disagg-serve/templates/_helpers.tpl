{{/* Names, labels and shared pieces of the disagg-serve chart. */}}

{{/* The chart name, or nameOverride. */}}
{{- define "disagg-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The resource name prefix: fullnameOverride, else <release>-<chart> (just <release> when it already holds the chart
name). 52 characters at most, so "<prefix>-orchestrator" stays within a 63-character DNS label.
*/}}
{{- define "disagg-serve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of one component's resources: (list $ "orchestrator"|"ctx"|"gen"). */}}
{{- define "disagg-serve.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "disagg-serve.fullname" $root) (index . 1) }}
{{- end }}

{{- define "disagg-serve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource of one component: (list $ component). */}}
{{- define "disagg-serve.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "disagg-serve.chart" $root }}
{{ include "disagg-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: disagg-serve
{{- end }}

{{/* Labels that select one component's pods: (list $ component); component "" for what all components share. */}}
{{- define "disagg-serve.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "disagg-serve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
{{- with index . 1 }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{- define "disagg-serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "disagg-serve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "disagg-serve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret holding the API and admin keys, or "" when there is none. */}}
{{- define "disagg-serve.authSecretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else if or .Values.auth.apiKey .Values.auth.adminKey }}
{{- include "disagg-serve.fullname" . }}
{{- end }}
{{- end }}

{{/*
The DNS name of a worker pool's headless Service: (list $ "ctx"|"gen"). It has one A record per ready pod, which
the orchestrator re-resolves every discoveryIntervalSeconds.
*/}}
{{- define "disagg-serve.workerDNSName" -}}
{{- $root := index . 0 }}
{{- printf "%s.%s.svc.%s" (include "disagg-serve.componentName" .) $root.Release.Namespace $root.Values.clusterDomain }}
{{- end }}

{{/*
The orchestrator's YAML. The chart owns hostname, port and the two pools (DNS discovery of the workers' headless
Services); everything else comes from .Values.orchestrator.config.
*/}}
{{- define "disagg-serve.orchestratorConfig" -}}
{{- $o := .Values.orchestrator }}
{{- $pools := dict
  "context_servers" (dict
    "discovery" (dict "dns_name" (include "disagg-serve.workerDNSName" (list . "ctx")) "port" (int .Values.ctx.port)
                      "scheme" "http" "interval_s" $o.discoveryIntervalSeconds)
    "router" (dict "type" $o.contextRouter)
    "max_running_prefills" (int $o.maxRunningPrefills))
  "generation_servers" (dict
    "discovery" (dict "dns_name" (include "disagg-serve.workerDNSName" (list . "gen")) "port" (int .Values.gen.port)
                      "scheme" "http" "interval_s" $o.discoveryIntervalSeconds)
    "router" (dict "type" $o.generationRouter))
}}
{{- $owned := merge (dict "hostname" "0.0.0.0" "port" (int $o.port)) $pools }}
{{- toYaml (merge $owned (deepCopy $o.config)) }}
{{- end }}

{{/* The writable /tmp every container gets, since the root filesystem is read-only. */}}
{{- define "disagg-serve.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{/*
The Secret holding the orchestrator's Responses store URL (DISAGG_RESPONSE_STORE_URL), or "" when there is none
(the store is then each process's memory): orchestrator.responseStore.existingSecret, else the chart-made one
when orchestrator.responseStore.url is set or the chart runs Redis.
*/}}
{{- define "disagg-serve.responseStoreSecretName" -}}
{{- $s := .Values.orchestrator.responseStore }}
{{- if $s.existingSecret }}
{{- $s.existingSecret }}
{{- else if or $s.url .Values.redis.enabled }}
{{- include "disagg-serve.componentName" (list . "response-store") }}
{{- end }}
{{- end }}

{{/* The key of the URL in that Secret. */}}
{{- define "disagg-serve.responseStoreSecretKey" -}}
{{- if .Values.orchestrator.responseStore.existingSecret }}
{{- .Values.orchestrator.responseStore.existingSecretKey }}
{{- else }}
{{- print "url" }}
{{- end }}
{{- end }}

{{/*
The chart's Redis password: redis.auth.password, else the one the chart-made Secret already holds (so an upgrade
keeps it), else 32 new random letters and digits. Evaluate it once per template: each call may draw anew.
*/}}
{{- define "disagg-serve.redisPassword" -}}
{{- if .Values.redis.auth.password }}
{{- .Values.redis.auth.password }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "disagg-serve.componentName" (list . "response-store")) }}
{{- $held := "" }}
{{- if $existing }}
{{- $held = index ($existing.data | default dict) "redis-password" | default "" }}
{{- end }}
{{- if $held }}
{{- $held | b64dec }}
{{- else }}
{{- randAlphaNum 32 }}
{{- end }}
{{- end }}
{{- end }}

{{/* The chart's Redis Service, as the orchestrator reaches it: <release>-disagg-serve-redis.<namespace>.svc.<domain>. */}}
{{- define "disagg-serve.redisHost" -}}
{{- printf "%s.%s.svc.%s" (include "disagg-serve.componentName" (list . "redis")) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/*
What rolls the orchestrator and Redis pods when the store's settings change (the pods read the Secret only at
start-up). The inputs, not the rendered Secret: a generated password would change the checksum on every render.
*/}}
{{- define "disagg-serve.responseStoreChecksum" -}}
{{- toJson (dict "store" .Values.orchestrator.responseStore "redis" (pick .Values.redis "enabled" "auth" "port")) | sha256sum }}
{{- end }}

{{/*
Settings that cannot work together stop the render with a message (helm install/upgrade/template fail).
*/}}
{{- define "disagg-serve.validateResponseStore" -}}
{{- $s := .Values.orchestrator.responseStore }}
{{- if and .Values.redis.enabled (or $s.existingSecret $s.url) }}
{{- fail "redis.enabled runs a Redis for the orchestrator's Responses store, and orchestrator.responseStore names another: set one of the two" }}
{{- end }}
{{- $config := .Values.orchestrator.config.response_store | default dict }}
{{- if and (kindIs "map" $config) $config.url }}
{{- fail "orchestrator.config.response_store.url would put the store's URL (and its password) in a ConfigMap: set orchestrator.responseStore.url or .existingSecret instead" }}
{{- end }}
{{- if and (kindIs "map" $config) (eq (toString $config.backend) "redis") (not (include "disagg-serve.responseStoreSecretName" .)) }}
{{- fail "orchestrator.config.response_store.backend: redis needs a URL: set orchestrator.responseStore.url or .existingSecret, or redis.enabled" }}
{{- end }}
{{- end }}

{{/*
Whether several orchestrator processes may run with no shared store (so that a follow-up can land where its turn
is not): "true" or "". A store turned off (max_entries: 0) is off by design and counts as shared.
*/}}
{{- define "disagg-serve.unsharedResponseStore" -}}
{{- $o := .Values.orchestrator }}
{{- $config := $o.config.response_store | default dict }}
{{- $off := and (kindIs "map" $config) (hasKey $config "max_entries") (eq (int $config.max_entries) 0) }}
{{- $several := ternary (gt (int $o.autoscaling.maxReplicas) 1) (gt (int $o.replicas) 1) (eq $o.autoscaling.enabled true) }}
{{- if and $several (not $off) (not (include "disagg-serve.responseStoreSecretName" .)) }}
{{- print "true" }}
{{- end }}
{{- end }}

{{/* The Secret holding the deployment secret (DISAGG_INTERNAL_TOKEN): the operator's, or the chart's. */}}
{{- define "disagg-serve.internalSecretName" -}}
{{- .Values.internalSecret.existingSecret | default (include "disagg-serve.componentName" (list . "internal")) }}
{{- end }}

{{- define "disagg-serve.internalSecretKey" -}}
{{- if .Values.internalSecret.existingSecret }}{{ .Values.internalSecret.existingSecretKey }}{{ else }}token{{ end }}
{{- end }}

{{/*
The chart-made deployment secret: internalSecret.token when given (at least 16 characters, as every process
requires), else the one this release already holds (read back from its Secret, so an upgrade keeps it and no pod
is left with a stale one), else 64 random letters and digits.
*/}}
{{- define "disagg-serve.internalToken" -}}
{{- $given := .Values.internalSecret.token }}
{{- if $given }}
{{- if lt (len $given) 16 }}
{{- fail "internalSecret.token must be at least 16 characters (e.g. `openssl rand -hex 32`), or empty to have one generated" }}
{{- end }}
{{- $given }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "disagg-serve.componentName" (list . "internal")) }}
{{- $held := "" }}
{{- if $existing }}
{{- $held = index ($existing.data | default dict) "token" | default "" }}
{{- end }}
{{- if $held }}
{{- $held | b64dec }}
{{- else }}
{{- randAlphaNum 64 }}
{{- end }}
{{- end }}
{{- end }}

{{/* DISAGG_INTERNAL_TOKEN for a container's env: the same Secret for every orchestrator and worker pod. */}}
{{- define "disagg-serve.internalTokenEnv" -}}
- name: DISAGG_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "disagg-serve.internalSecretName" . }}
      key: {{ include "disagg-serve.internalSecretKey" . }}
{{- end }}
