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
{{- $scheme := ternary "https" "http" (.Values.tls.enabled | default false) -}}
{{- range $i, $_ := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "%s://%s-etcd-%d.%s-etcd:2379" $scheme $fn $i $fn) -}}
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

{{/*
Probes, as exec of parsectl health (kubelet's own gRPC probe speaks no TLS): dict root, port, [serverName].
startup: model load and a TP group's rendezvous (up to startupSeconds); liveness: the server answers health at
all (--live: a worker that lost etcd is not ready, but restarting it would not bring etcd back); readiness: SERVING.
*/}}
{{- define "parse.probes" -}}
{{- $cmd := list "/usr/local/bin/parsectl" "health" (printf "127.0.0.1:%v" .port) }}
{{- with .serverName }}{{- $cmd = concat $cmd (list "--tls-server-name" .) }}{{- end }}
startupProbe:
  exec:
    command: {{ toJson (append $cmd "--live") }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ div (int .root.Values.probes.startupSeconds) 10 }}
readinessProbe:
  exec:
    command: {{ toJson $cmd }}
  periodSeconds: 5
  timeoutSeconds: 4
  failureThreshold: 2
livenessProbe:
  exec:
    command: {{ toJson (append $cmd "--live") }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* TLS environment of a PARSE container: dict root, role (router|worker). */}}
{{- define "parse.tlsEnv" -}}
{{- if .root.Values.tls.enabled }}
- {name: PARSE_TLS_CERT, value: /tls/tls.crt}
- {name: PARSE_TLS_KEY, value: /tls/tls.key}
- {name: PARSE_TLS_CA, value: /tls/ca.crt}
{{- if not .root.Values.etcd.external.endpoints }}
- {name: PARSE_ETCD_CA, value: /tls/ca.crt}
- {name: PARSE_ETCD_CERT, value: /tls/tls.crt}
- {name: PARSE_ETCD_KEY, value: /tls/tls.key}
{{- end }}
{{- if eq .role "router" }}
# Workers are dialled by pod address; their certificates name the role.
- {name: PARSE_TLS_SERVER_NAME, value: parse-worker}
{{- end }}
{{- end }}
# Workers refuse calls without it; the router sends it; TP ranks authenticate each other with it.
- name: PARSE_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.clusterToken.existingSecret | default (printf "%s-cluster-token" (include "parse.fullname" .root)) }}
      key: token
{{- end -}}

{{- define "parse.tlsSecret" -}}
{{- $fn := include "parse.fullname" .root -}}
{{- if eq .role "router" -}}
{{- .root.Values.tls.routerSecret | default (printf "%s-tls-router" $fn) -}}
{{- else -}}
{{- .root.Values.tls.workerSecret | default (printf "%s-tls-worker" $fn) -}}
{{- end -}}
{{- end -}}

{{- define "parse.tlsMount" -}}
{{- if .Values.tls.enabled }}
- {name: tls, mountPath: /tls, readOnly: true}
{{- end }}
{{- end -}}

{{- define "parse.tlsVolume" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "parse.tlsSecret" . }}
    # Group-readable: the pod's fsGroup owns it, the process runs as a non-root user.
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/*
Memory of a worker container from its model: the weights file, the KV cache budget, the prompts kept for prefix
caching and a fixed overhead (runtime, activations, tokenizer). Requests equal limits, so a worker is never the first
the node evicts. dict res, modelMiB, kvMiB, prefixCacheMiB, overheadMiB. Explicit resources.limits.memory wins.
*/}}
{{- define "parse.workerResources" -}}
{{- $res := deepCopy .res }}
{{- $mem := printf "%dMi" (add (int .modelMiB) (int .kvMiB) (int (default 0 .prefixCacheMiB)) (int .overheadMiB)) }}
{{- $limits := default dict $res.limits }}
{{- if not (hasKey $limits "memory") }}
{{- $_ := set $limits "memory" $mem }}
{{- end }}
{{- $_ := set $res "limits" $limits }}
{{- $requests := default dict $res.requests }}
{{- if not (hasKey $requests "memory") }}
{{- $_ := set $requests "memory" (get $limits "memory") }}
{{- end }}
{{- $_ := set $res "requests" $requests }}
{{- toYaml $res }}
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
# No pod talks to the Kubernetes API.
automountServiceAccountToken: false
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
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
  {{- if .scheme }}
  prometheus.io/scheme: {{ .scheme }}
  {{- end }}
{{- end }}
{{- end }}
