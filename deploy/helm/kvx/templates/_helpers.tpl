{{/* Chart name. */}}
{{- define "kvx.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified release name (kept short: components append a suffix). */}}
{{- define "kvx.fullname" -}}
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

{{- define "kvx.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; call with (dict "root" $ "component" "frontend"). */}}
{{- define "kvx.labels" -}}
helm.sh/chart: {{ include "kvx.chart" .root }}
{{ include "kvx.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvx
{{- end -}}

{{- define "kvx.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvx.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvx.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvx.discoveryNamespace" -}}
{{- default .Release.Name .Values.discovery.namespace -}}
{{- end -}}

{{/* etcd client endpoints: the external ones, or the chart's etcd Service. */}}
{{- define "kvx.etcdEndpoints" -}}
{{- if .Values.discovery.etcdEndpoints -}}
{{- .Values.discovery.etcdEndpoints -}}
{{- else -}}
{{- printf "http://%s-etcd.%s.svc.%s:2379" (include "kvx.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}
{{- end -}}

{{/* Checks of values that would render a fleet that cannot work. */}}
{{- define "kvx.validate" -}}
{{- if not (has .Values.mode (list "disagg" "agg")) -}}
{{- fail (printf "mode must be disagg or agg, not %q" .Values.mode) -}}
{{- end -}}
{{- if not (has .Values.discovery.mode (list "etcd" "frontend")) -}}
{{- fail (printf "discovery.mode must be etcd or frontend, not %q" .Values.discovery.mode) -}}
{{- end -}}
{{- if and (eq .Values.discovery.mode "frontend") (gt (int .Values.frontend.replicas) 1) -}}
{{- fail "discovery.mode frontend allows one frontend replica: workers dial one frontend; use discovery.mode etcd for more" -}}
{{- end -}}
{{- if and (eq .Values.discovery.mode "etcd") (not .Values.etcd.enabled) (not .Values.discovery.etcdEndpoints) -}}
{{- fail "discovery.mode etcd needs etcd.enabled or discovery.etcdEndpoints" -}}
{{- end -}}
{{- end -}}

{{/* Environment wiring discovery and cluster membership, for frontends and workers. */}}
{{- define "kvx.discoveryEnv" -}}
{{- if eq .Values.discovery.mode "etcd" }}
- name: KVX_DISCOVERY
  value: etcd
- name: KVX_ETCD_ENDPOINTS
  value: {{ include "kvx.etcdEndpoints" . | quote }}
- name: KVX_NAMESPACE
  value: {{ include "kvx.discoveryNamespace" . | quote }}
{{- end }}
{{- if .Values.cluster.tokenSecret }}
- name: KVX_CLUSTER_TOKEN_FILE
  value: /etc/kvx/cluster/token
{{- end }}
{{- end -}}

{{/* envFrom of every kvx container. */}}
{{- define "kvx.envFrom" -}}
- configMapRef:
    name: {{ include "kvx.fullname" . }}-config
{{- if .Values.secretEnvFrom }}
- secretRef:
    name: {{ .Values.secretEnvFrom }}
{{- end }}
{{- end -}}

{{/* Volumes of every kvx pod: the model store, /tmp, the cluster token. */}}
{{- define "kvx.volumes" -}}
- name: kvx-home
{{- if .Values.modelStore.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-models" (include "kvx.fullname" .)) .Values.modelStore.persistence.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.modelStore.emptyDirSizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- if .Values.cluster.tokenSecret }}
- name: cluster-token
  secret:
    secretName: {{ .Values.cluster.tokenSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "kvx.volumeMounts" -}}
- name: kvx-home
  mountPath: {{ .Values.modelStore.mountPath }}
- name: tmp
  mountPath: /tmp
{{- if .Values.cluster.tokenSecret }}
- name: cluster-token
  mountPath: /etc/kvx/cluster
  readOnly: true
{{- end }}
{{- end -}}

{{/* Environment every kvx container has: its home, pip's scratch. */}}
{{- define "kvx.baseEnv" -}}
- name: KVX_HOME
  value: {{ .Values.modelStore.mountPath | quote }}
- name: HOME
  value: /tmp
- name: PIP_NO_CACHE_DIR
  value: "1"
{{- with .Values.modelStore.model }}
- name: KVX_MODEL
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The initContainer that pulls the model into the store. */}}
{{- define "kvx.modelPull" -}}
{{- if .Values.modelStore.pull }}
initContainers:
  - name: model-pull
    image: {{ include "kvx.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    args: ["model", "pull"{{ with .Values.modelStore.model }}, {{ . | quote }}{{ end }}]
    envFrom:
      {{- include "kvx.envFrom" . | nindent 6 }}
    env:
      {{- include "kvx.baseEnv" . | nindent 6 }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      {{- include "kvx.volumeMounts" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* Best-effort spread over nodes; call with (dict "root" $ "component" "frontend"). */}}
{{- define "kvx.topologySpread" -}}
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: kubernetes.io/hostname
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "kvx.selectorLabels" . | nindent 8 }}
{{- end -}}
