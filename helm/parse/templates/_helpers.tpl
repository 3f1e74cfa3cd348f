{{- define "parse.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "parse.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "parse.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "parse.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "parse.etcdEndpoints" -}}
{{- if .Values.etcd.external.endpoints -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- $fn := include "parse.fullname" . -}}
{{- $eps := list -}}
{{- range $i, $_ := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "http://%s-etcd-%d.%s-etcd:2379" $fn $i $fn) -}}
{{- end -}}
{{- join "," $eps -}}
{{- end -}}
{{- end -}}

{{- define "parse.adminSecret" -}}
{{- .Values.router.admin.existingSecret | default (printf "%s-admin" (include "parse.fullname" .)) -}}
{{- end -}}

{{/* The model volume: a claim or a host path, read-only. */}}
{{- define "parse.modelsVolume" -}}
- name: models
{{- if .Values.models.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
    readOnly: true
{{- else if .Values.models.hostPath }}
  hostPath:
    path: {{ .Values.models.hostPath }}
    type: Directory
{{- else }}
  {{- fail "set models.existingClaim or models.hostPath: where the model files are" }}
{{- end }}
{{- end -}}

{{- define "parse.podEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: PARSE_ETCD
  value: {{ include "parse.etcdEndpoints" . | quote }}
{{- with .Values.tracing.otlpEndpoint }}
# Spans over OTLP/gRPC (each service names itself: parse-router, parse-draft-worker, parse-target-worker).
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "parse.probes" -}}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ .port }}
  initialDelaySeconds: 60
  periodSeconds: 10
  failureThreshold: 6
{{- end -}}

{{- define "parse.scheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "parse.securityContext" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
{{- end -}}

{{- define "parse.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/* Pod annotations for annotation-based Prometheus scraping: dict root, port. */}}
{{- define "parse.metricsAnnotations" -}}
{{- if and .root.Values.metrics.enabled .root.Values.metrics.podAnnotations }}
annotations:
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ .port | quote }}
  prometheus.io/path: /metrics
{{- end }}
{{- end }}
