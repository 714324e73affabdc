{{- define "tfprofd.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tfprofd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tfprofd.labels" -}}
app.kubernetes.io/name: {{ include "tfprofd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tfprofd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tfprofd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tfprofd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tfprofd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The agent container's securityContext: runAsGroup is captureDir.group; root (still without any
capability) only when it must reach the kubelet's root-owned PodResources socket. */}}
{{- define "tfprofd.securityContext" -}}
{{- $ctx := deepCopy .Values.securityContext -}}
{{- $_ := set $ctx "runAsGroup" (int .Values.captureDir.group) -}}
{{- if .Values.podResources.enabled -}}
{{- $_ := set $ctx "runAsUser" 0 -}}
{{- $_ := set $ctx "runAsNonRoot" false -}}
{{- end -}}
{{- toYaml $ctx -}}
{{- end -}}

{{/* The uid the agent runs as (the owner the init container gives captureDir). */}}
{{- define "tfprofd.runAsUser" -}}
{{- if .Values.podResources.enabled -}}0{{- else -}}{{ .Values.securityContext.runAsUser | default 65534 | int }}{{- end -}}
{{- end -}}

{{/* Where the control API listens: all interfaces of the pod when alerts are routed between agents. */}}
{{- define "tfprofd.apiListen" -}}
{{- if .Values.alertRouting.enabled -}}0.0.0.0{{- else -}}{{ .Values.api.listen }}{{- end -}}
{{- end -}}

{{/* Refuse value combinations that would render something that cannot work. */}}
{{- define "tfprofd.validate" -}}
{{- if and .Values.serviceMonitor.enabled (not .Values.service.enabled) -}}
{{- fail "serviceMonitor.enabled needs service.enabled: a ServiceMonitor selects the chart's Service" -}}
{{- end -}}
{{- range $key, $_ := include "tfprofd.selectorLabels" . | fromYaml -}}
{{- if hasKey $.Values.podLabels $key -}}
{{- fail (printf "podLabels.%s: the chart's selector sets this label; choose another key" $key) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.cluster.prometheusUrl (not .Values.alertRouting.enabled) -}}
{{- fail "cluster.prometheusUrl needs alertRouting.enabled: the agents ask each other with the shared token" -}}
{{- end -}}
{{- if .Values.alertRouting.enabled -}}
{{- if not .Values.api.token.existingSecret -}}
{{- fail "alertRouting.enabled needs api.token.existingSecret: every agent must share one token" -}}
{{- end -}}
{{- if not .Values.alertRouting.forwardNetworks -}}
{{- fail "alertRouting.enabled needs alertRouting.forwardNetworks: the IP networks of the nodes (or pods)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
