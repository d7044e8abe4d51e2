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
    "router" (dict "type" $o.contextRouter))
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
