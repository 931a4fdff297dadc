{{/* Names and labels, as Helm's own starter chart writes them. */}}
{{- define "weightserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "weightserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The headless Service's name; trimmed so the suffix always fits in 63 characters. */}}
{{- define "weightserve.headlessName" -}}
{{- printf "%s-headless" (include "weightserve.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{- define "weightserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weightserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "weightserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "weightserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: {{ ternary "node-cache" "server" (eq .Values.mode "daemonset") }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "weightserve.annotations" -}}
{{- with .Values.commonAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "weightserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "weightserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "weightserve.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The scheme clients use: https when the server has a certificate. */}}
{{- define "weightserve.httpScheme" -}}
{{- ternary "https" "http" (ne .Values.tls.secret "") }}
{{- end }}

{{/*
--cache-size: cache.maxBytes, else nine tenths of cache.size in MiB (the rest holds the digest
store and files being filled), else nothing (the server takes 9/10 of the free disk).
*/}}
{{- define "weightserve.cacheSize" -}}
{{- if .Values.cache.maxBytes }}
{{- .Values.cache.maxBytes }}
{{- else if .Values.cache.size }}
{{- $number := regexFind "^[0-9]+" .Values.cache.size | int64 }}
{{- $unit := trimPrefix (toString $number) .Values.cache.size }}
{{- $mebibytes := dict "Mi" 1 "Gi" 1024 "Ti" 1048576 }}
{{- printf "%dMiB" (div (mul $number (get $mebibytes $unit) 9) 10) }}
{{- end }}
{{- end }}

{{/*
The cache volume's type: cache.type, else by mode. A daemonset's node cache is a hostPath, so a
rolling upgrade finds each node's cache where the old pod left it; a deployment's is an emptyDir.
*/}}
{{- define "weightserve.cacheType" -}}
{{- .Values.cache.type | default (ternary "hostPath" "emptyDir" (eq .Values.mode "daemonset")) }}
{{- end }}

{{/*
The node directory of a hostPath cache: cache.hostPath.path, else one per release (namespace
and name), so two releases on a node never share a cache directory (the server locks it).
*/}}
{{- define "weightserve.cacheHostPath" -}}
{{- .Values.cache.hostPath.path | default (printf "/var/lib/weightserve/%s/%s" .Release.Namespace .Release.Name) }}
{{- end }}

{{/* Refuse combinations the schema cannot express, naming the values to change. */}}
{{- define "weightserve.validate" -}}
{{- $cacheType := include "weightserve.cacheType" . }}
{{- if eq $cacheType "persistentVolumeClaim" }}
{{- if eq .Values.mode "daemonset" }}
{{- fail "cache.type=persistentVolumeClaim cannot be used with mode=daemonset: one claim cannot be every node's cache; use hostPath or emptyDir" }}
{{- end }}
{{- if or (gt (int .Values.replicaCount) 1) .Values.autoscaling.enabled }}
{{- fail "cache.type=persistentVolumeClaim needs replicaCount=1 and autoscaling.enabled=false: replicas cannot share one node cache; use emptyDir (each replica fills its own) or run one release per volume" }}
{{- end }}
{{- end }}
{{- $surge := dig "rollingUpdate" "maxSurge" 0 .Values.daemonset.updateStrategy | toString }}
{{- if and (eq .Values.mode "daemonset") (eq $cacheType "hostPath") (not (has $surge (list "0" "0%"))) }}
{{- fail "daemonset.updateStrategy.rollingUpdate.maxSurge must be 0 with a hostPath cache: the new pod would start beside the old one on the node's locked cache directory" }}
{{- end }}
{{- if and .Values.tls.requireClientCert (not .Values.tls.secret) }}
{{- fail "tls.requireClientCert=true needs tls.secret (a Secret with tls.crt, tls.key and ca.crt)" }}
{{- end }}
{{- if and .Values.hostPort.enabled (ne .Values.mode "daemonset") }}
{{- fail "hostPort.enabled=true is for mode=daemonset (one server per node)" }}
{{- end }}
{{- if and .Values.nodeSocket.enabled (ne .Values.mode "daemonset") }}
{{- fail "nodeSocket.enabled=true is for mode=daemonset: the same-node socket needs one server on every client's node" }}
{{- end }}
{{- end }}

{{/* The startup and readiness check: gRPC health unless TLS keeps the kubelet from it. */}}
{{- define "weightserve.readyCheck" -}}
{{- if and .Values.tls.secret .Values.tls.requireClientCert }}
tcpSocket:
  port: grpc
{{- else if .Values.tls.secret }}
httpGet:
  path: /readyz
  port: http
  scheme: HTTPS
{{- else }}
grpc:
  port: {{ .Values.ports.grpc }}
{{- end }}
{{- end }}

{{/* The user and group the server runs as: the container's, else the pod's. */}}
{{- define "weightserve.runAsUser" -}}
{{- .Values.securityContext.runAsUser | default .Values.podSecurityContext.runAsUser | default 10001 }}
{{- end }}
{{- define "weightserve.runAsGroup" -}}
{{- .Values.securityContext.runAsGroup | default .Values.podSecurityContext.runAsGroup | default (include "weightserve.runAsUser" .) }}
{{- end }}

{{/* Whether the pods run peer fills: on, and a node cache over a central weightserve. */}}
{{- define "weightserve.peers" -}}
{{- if and .Values.peers.enabled (hasPrefix "http" .Values.origin.url) }}true{{ end }}
{{- end }}
