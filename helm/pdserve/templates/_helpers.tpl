{{/* Names, labels and the pieces every pdserve container shares. */}}

{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one role: call with (dict "ctx" $ "role" "decode"). */}}
{{- define "pdserve.selector" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "pdserve.fullname" . }}-redis:6379/0
{{- else -}}
{{ .Values.redis.external.url }}
{{- end -}}
{{- end -}}

{{- define "pdserve.internalTokenSecret" -}}
{{ .Values.internalToken.existingSecret | default (printf "%s-internal-token" (include "pdserve.fullname" .)) }}
{{- end -}}

{{- define "pdserve.apiKeySecret" -}}
{{ .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "pdserve.fullname" .)) }}
{{- end -}}

{{/* How many addresses the router lists for a role: every replica autoscaling may create
     (an address with no pod behind it is polled and skipped as unhealthy). */}}
{{- define "pdserve.maxReplicas" -}}
{{- $role := index .ctx.Values .role -}}
{{- if eq .ctx.Values.autoscaling.mode "none" -}}
{{ $role.replicas }}
{{- else -}}
{{ max $role.replicas $role.autoscaling.maxReplicas }}
{{- end -}}
{{- end -}}

{{/* Comma-separated stable addresses of a StatefulSet role's pods. */}}
{{- define "pdserve.workerAddresses" -}}
{{- $name := printf "%s-%s" (include "pdserve.fullname" .ctx) .role -}}
{{- $port := (index .ctx.Values .role).port -}}
{{- $count := include "pdserve.maxReplicas" . | int -}}
{{- $addresses := list -}}
{{- range $i := until $count -}}
{{- $addresses = append $addresses (printf "%s-%d.%s.%s.svc:%d" $name $i $name $.ctx.Release.Namespace (int $port)) -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* Environment every pdserve container gets. */}}
{{- define "pdserve.commonEnv" -}}
- name: PDSERVE_HOST
  value: 0.0.0.0
- name: PDSERVE_TRANSFER
  value: {{ .Values.transfer | quote }}
- name: PDSERVE_DRAIN_GRACE_S
  value: {{ .Values.drainGraceSeconds | quote }}
- name: PDSERVE_REDIS_URL
  value: {{ include "pdserve.redisUrl" . | quote }}
- name: PDSERVE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.internalTokenSecret" . }}
      key: {{ .Values.internalToken.key }}
{{- if .Values.ucxNetDevices }}
- name: UCX_NET_DEVICES
  value: {{ .Values.ucxNetDevices | quote }}
{{- end }}
{{- if ne .Values.model.source "embedded" }}
- name: PDSERVE_MODEL
  value: {{ printf "/models/%s" .Values.model.path | trimSuffix "/" | quote }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelVolumeMounts" -}}
{{- if ne .Values.model.source "embedded" }}
- name: model
  mountPath: /models
  readOnly: {{ ne .Values.model.source "initContainer" }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelVolumes" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else if eq .Values.model.source "initContainer" }}
- name: model
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "pdserve.initContainers" -}}
{{- if eq .Values.model.source "initContainer" }}
initContainers:
  - name: fetch-model
    image: {{ .Values.model.initContainer.image }}
    command: {{ toJson .Values.model.initContainer.command }}
    volumeMounts:
      - name: model
        mountPath: /models
{{- end }}
{{- end -}}

{{/* Native gRPC probes against grpc.health.v1 on one port. The router's health mirrors its
     workers' (no healthy worker: NOT_SERVING), so its liveness only checks that the port
     accepts connections: workers being down must not restart every router. */}}
{{- define "pdserve.grpcProbes" -}}
startupProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: {{ .ctx.Values.startupProbe.periodSeconds }}
  failureThreshold: {{ .ctx.Values.startupProbe.failureThreshold }}
livenessProbe:
  {{- if .livenessTCP }}
  tcpSocket: {port: {{ .port }}}
  {{- else }}
  grpc: {port: {{ .port }}}
  {{- end }}
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 6
readinessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 5
  timeoutSeconds: 2
  failureThreshold: 2
{{- end -}}

{{- define "pdserve.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
{{- end -}}

{{- define "pdserve.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  capabilities: {drop: ["ALL"]}
{{- end -}}
