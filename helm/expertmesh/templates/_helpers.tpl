{{/* Names ------------------------------------------------------------------ */}}

{{- define "expertmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object-name prefix, kept short: KubeRay derives RayCluster, pod and Service names from it. */}}
{{- define "expertmesh.fullname" -}}
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

{{- define "expertmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels; call with (dict "ctx" $ "component" "router"). */}}
{{- define "expertmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "expertmesh.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "expertmesh.labels" -}}
{{ include "expertmesh.selectorLabels" . }}
app.kubernetes.io/part-of: expertmesh
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ include "expertmesh.chart" .ctx }}
{{- end -}}

{{/* Labels every platform pod carries: the Redis NetworkPolicy admits exactly these. */}}
{{- define "expertmesh.platformPodSelector" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: expertmesh
{{- end -}}

{{- define "expertmesh.serviceAccountName" -}}
{{- include "expertmesh.fullname" . -}}
{{- end -}}

{{- define "expertmesh.orchestratorServiceAccountName" -}}
{{- include "expertmesh.fullname" . -}}-orchestrator
{{- end -}}

{{- define "expertmesh.rayServiceName" -}}
{{- include "expertmesh.fullname" . -}}-groups
{{- end -}}

{{/* Images ----------------------------------------------------------------- */}}

{{- define "expertmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "expertmesh.workerImage" -}}
{{- if eq .Values.mode "gpu" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.gpuTag | default (printf "%s-cuda" (.Values.image.tag | default .Chart.AppVersion))) -}}
{{- else -}}
{{- include "expertmesh.image" . -}}
{{- end -}}
{{- end -}}

{{/* Redis ------------------------------------------------------------------ */}}

{{- define "expertmesh.redisBundled" -}}
{{- if not .Values.redis.external.url -}}true{{- end -}}
{{- end -}}

{{/* "true" when the bundled Redis serves TLS only (redis.tls.enabled). */}}
{{- define "expertmesh.redisTLS" -}}
{{- if and (include "expertmesh.redisBundled" .) .Values.redis.tls.enabled -}}true{{- end -}}
{{- end -}}

{{- define "expertmesh.redisURL" -}}
{{- if .Values.redis.external.url -}}
{{- .Values.redis.external.url -}}
{{- else -}}
{{- printf "%s://%s-redis:6379/0" (ternary "rediss" "redis" (eq (include "expertmesh.redisTLS" .) "true")) (include "expertmesh.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The Secret of the bundled Redis's users' passwords (keys router, expert-group, orchestrator). */}}
{{- define "expertmesh.redisAuthSecret" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis-auth" (include "expertmesh.fullname" .)) -}}
{{- end -}}

{{/* The Secret of the bundled Redis's TLS certificate (tls.crt, tls.key, ca.crt). */}}
{{- define "expertmesh.redisTlsSecret" -}}
{{- .Values.redis.tls.existingSecret | default (printf "%s-redis-tls" (include "expertmesh.fullname" .)) -}}
{{- end -}}

{{/* "secret|key|user" of a component's Redis credentials, or "" for none; call with (dict "ctx" $ "component" c).
     The bundled Redis, and an external one with redis.external.users, give each component a user of its own
     (named like the component; its password under the key of that name); an external one without users: the
     default user, with redis.external.passwordKey's password when a Secret is named. */}}
{{- define "expertmesh.redisCredentials" -}}
{{- $r := .ctx.Values.redis -}}
{{- if not $r.external.url -}}
{{- include "expertmesh.redisAuthSecret" .ctx }}|{{ .component }}|{{ .component -}}
{{- else if $r.external.users -}}
{{- if not $r.external.existingSecret -}}
{{- fail "redis.external.users: name the Secret of the users' passwords (keys router, expert-group, orchestrator) in redis.external.existingSecret" -}}
{{- end -}}
{{- $r.external.existingSecret }}|{{ .component }}|{{ .component -}}
{{- else if $r.external.existingSecret -}}
{{- $r.external.existingSecret }}|{{ $r.external.passwordKey }}|
{{- end -}}
{{- end -}}

{{/* "secret|key" of the CA a component verifies Redis's certificate with, or "": the bundled Redis's own under
     redis.tls, an external one's redis.external.tls.caSecret. */}}
{{- define "expertmesh.redisCA" -}}
{{- if include "expertmesh.redisTLS" . -}}
{{- include "expertmesh.redisTlsSecret" . }}|ca.crt
{{- else if and .Values.redis.external.url .Values.redis.external.tls.caSecret -}}
{{- .Values.redis.external.tls.caSecret }}|{{ .Values.redis.external.tls.caKey -}}
{{- end -}}
{{- end -}}

{{/* Security ---------------------------------------------------------------- */}}

{{/* "true" when the chart generates the TLS CA and certificates (tls.enabled, no Secrets given). */}}
{{- define "expertmesh.tlsGenerated" -}}
{{- $t := .Values.tls -}}
{{- $given := compact (list $t.routerSecret $t.orchestratorSecret $t.expertGroupsSecret) -}}
{{- if and $given (lt (len $given) 3) -}}
{{- fail "tls: set routerSecret, orchestratorSecret and expertGroupsSecret together (one CA must sign all three), or none and the chart generates them" -}}
{{- end -}}
{{- if and $t.enabled (not $given) -}}true{{- end -}}
{{- end -}}

{{/* TLS Secret of a component; call with (dict "ctx" $ "component" "router"|"orchestrator"|"expert-group"). */}}
{{- define "expertmesh.tlsSecret" -}}
{{- $t := .ctx.Values.tls -}}
{{- $given := get (dict "router" $t.routerSecret "orchestrator" $t.orchestratorSecret "expert-group" $t.expertGroupsSecret) .component -}}
{{- $given | default (printf "%s-tls-%s" (include "expertmesh.fullname" .ctx) .component) -}}
{{- end -}}

{{/* The name routers and the orchestrator verify in the expert groups' certificate. */}}
{{- define "expertmesh.groupServerName" -}}
{{- .Values.tls.groupServerName | default (include "expertmesh.rayServiceName" .) -}}
{{- end -}}

{{- define "expertmesh.adminTokenSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-admin-token" (include "expertmesh.fullname" .)) -}}
{{- end -}}

{{/* Comma-separated admin CNs: auth.adminCommonNames, plus the orchestrator's generated certificate. */}}
{{- define "expertmesh.adminCommonNames" -}}
{{- $cns := .Values.auth.adminCommonNames -}}
{{- if and (include "expertmesh.tlsGenerated" .) .Values.orchestrator.enabled -}}
{{- $cns = append $cns (printf "%s-orchestrator" (include "expertmesh.fullname" .)) -}}
{{- end -}}
{{- join "," (uniq $cns) -}}
{{- end -}}

{{/* Port of a URL (call with (dict "url" u "default" p)): its explicit port, else the default. */}}
{{- define "expertmesh.urlPort" -}}
{{- $host := (urlParse .url).host -}}
{{- if regexMatch ":[0-9]+$" $host -}}{{ regexFind "[0-9]+$" $host }}{{- else -}}{{ .default }}{{- end -}}
{{- end -}}

{{/* Environment of every expertmesh container; call with (dict "ctx" $ "component" "router"). */}}
{{- define "expertmesh.env" -}}
{{- $ctx := .ctx -}}
- name: EXPERTMESH_STATE_URL
  value: {{ include "expertmesh.redisURL" $ctx | quote }}
{{- with include "expertmesh.redisCredentials" . }}
{{- $cred := splitList "|" . }}
{{- with index $cred 2 }}
- name: EXPERTMESH_REDIS_USERNAME
  value: {{ . | quote }}
{{- end }}
{{- /* A file, never the environment or a command line: the redis-auth volume holds this component's key alone. */}}
- name: EXPERTMESH_REDIS_PASSWORD_FILE
  value: /etc/expertmesh-redis/password
{{- end }}
{{- with include "expertmesh.redisCA" $ctx }}
- name: EXPERTMESH_REDIS_CA_FILE
  value: /etc/expertmesh-tls/redis/{{ index (splitList "|" .) 1 }}
{{- end }}
{{- if $ctx.Values.tls.enabled }}
- name: EXPERTMESH_TLS_CERT_FILE
  value: /etc/expertmesh-tls/grpc/tls.crt
- name: EXPERTMESH_TLS_KEY_FILE
  value: /etc/expertmesh-tls/grpc/tls.key
- name: EXPERTMESH_TLS_CA_FILE
  value: /etc/expertmesh-tls/grpc/ca.crt
{{- if ne .component "expert-group" }}
- name: EXPERTMESH_TLS_GROUP_SERVER_NAME
  value: {{ include "expertmesh.groupServerName" $ctx | quote }}
{{- if $ctx.Values.tls.requireClientCert }}
- name: EXPERTMESH_TLS_REQUIRE_CLIENT_CERT
  value: "true"
{{- end }}
{{- end }}
{{- end }}
{{- /* Admin identities: the servers that check them (groups, orchestrator) and the orchestrator as caller; not the router. */}}
{{- if ne .component "router" }}
- name: EXPERTMESH_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "expertmesh.adminTokenSecret" $ctx | quote }}
      key: {{ $ctx.Values.auth.tokenKey | quote }}
{{- with include "expertmesh.adminCommonNames" $ctx }}
- name: EXPERTMESH_ADMIN_ALLOWED_CNS
  value: {{ . | quote }}
{{- end }}
{{- end }}
- name: EXPERTMESH_DTYPE
  value: {{ $ctx.Values.model.dtype | quote }}
- name: EXPERTMESH_K8S_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: EXPERTMESH_RAYSERVICE
  value: {{ include "expertmesh.rayServiceName" $ctx | quote }}
- name: HOME
  value: /tmp/home
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: HF_HUB_OFFLINE
  value: "1"
{{- if $ctx.Values.otel.enabled }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "expertmesh-%s" .component | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $ctx.Values.otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $ctx.Values.otel.protocol | quote }}
{{- with $ctx.Values.otel.headers.existingSecret }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ . | quote }}
      key: {{ $ctx.Values.otel.headers.key | quote }}
{{- end }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $ctx.Values.otel.samplingRatio | toString | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=expertmesh,k8s.namespace.name=%s%s" $ctx.Release.Namespace (ternary (printf ",%s" $ctx.Values.otel.resourceAttributes) "" (ne $ctx.Values.otel.resourceAttributes "")) | quote }}
{{- else if not (and (eq .component "router") $ctx.Values.router.http.enabled) }}
{{- /* A router with the HTTP API keeps the SDK on: its /metrics reads the SDK's meters (no OTLP export without an endpoint). */}}
- name: OTEL_SDK_DISABLED
  value: "true"
{{- end }}
{{- with $ctx.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes: model (read-only), writable /tmp, the component's Redis password and Redis CA, its gRPC TLS Secret.
     Call with (dict "ctx" $ "component" "router"|"orchestrator"|"expert-group"). */}}
{{- define "expertmesh.volumes" -}}
{{- $ctx := .ctx -}}
- name: tmp
  emptyDir: {}
{{- if $ctx.Values.model.pvc.claimName }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $ctx.Values.model.pvc.claimName | quote }}
    readOnly: true
{{- else if $ctx.Values.model.hostPath }}
- name: model
  hostPath:
    path: {{ $ctx.Values.model.hostPath | quote }}
    type: Directory
{{- end }}
{{- with include "expertmesh.redisCredentials" . }}
{{- $cred := splitList "|" . }}
- name: redis-auth
  secret:
    secretName: {{ index $cred 0 | quote }}
    items:
      - {key: {{ index $cred 1 | quote }}, path: password}
    # Owner and group (fsGroup) only: it holds this component's Redis password.
    defaultMode: 0440
{{- end }}
{{- with include "expertmesh.redisCA" $ctx }}
{{- $ca := splitList "|" . }}
- name: redis-tls
  secret:
    secretName: {{ index $ca 0 | quote }}
    items:
      - {key: {{ index $ca 1 | quote }}, path: {{ index $ca 1 | quote }}}
    defaultMode: 0444
{{- end }}
{{- if $ctx.Values.tls.enabled }}
- name: grpc-tls
  secret:
    secretName: {{ include "expertmesh.tlsSecret" . | quote }}
    # Owner and group (fsGroup) only: it holds the private key.
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "expertmesh.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if or .Values.model.pvc.claimName .Values.model.hostPath }}
- name: model
  mountPath: {{ .Values.model.mountPath | quote }}
  readOnly: true
  {{- if and .Values.model.pvc.claimName .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath | quote }}
  {{- end }}
{{- end }}
{{- if or (not .Values.redis.external.url) .Values.redis.external.existingSecret }}
- name: redis-auth
  mountPath: /etc/expertmesh-redis
  readOnly: true
{{- end }}
{{- if include "expertmesh.redisCA" . }}
- name: redis-tls
  mountPath: /etc/expertmesh-tls/redis
  readOnly: true
{{- end }}
{{- if .Values.tls.enabled }}
- name: grpc-tls
  mountPath: /etc/expertmesh-tls/grpc
  readOnly: true
{{- end }}
{{- end -}}

{{/* Topology ----------------------------------------------------------------
  JSON with
    islands: [{name, node, clique, gpuProduct, gpus, resources, groups: [names], resource}]
    groups:  [{name, index, port, island, gpus, experts}]; index = position in name order, the
             order of serveConfigV2 args.placement.groups (toYaml sorts keys), so port = portBase + index
    pooled:  [names of groups in the default worker pool]
  Checks what the schema cannot: unique names, one node per island, GPUs fit.
*/}}
{{- define "expertmesh.topology" -}}
{{- $gpu := eq .Values.mode "gpu" -}}
{{- $eg := .Values.expertGroups -}}
{{- $islands := dict -}}
{{- $order := list -}}
{{- range $eg.islands -}}
{{- if hasKey $islands .name -}}
{{- fail (printf "expertGroups.islands: island %q is listed twice" .name) -}}
{{- end -}}
{{- $_ := set $islands .name (dict "name" .name "node" (.node | default "") "clique" (.clique | default "") "gpuProduct" (.gpuProduct | default "") "declaredGpus" (.gpus | default 0 | int) "resources" (.resources | default dict) "groups" list "used" 0) -}}
{{- $order = append $order .name -}}
{{- end -}}
{{- $groups := list -}}
{{- $pooled := list -}}
{{- $names := dict -}}
{{- $sorted := list -}}
{{- range $eg.groups -}}{{- $sorted = append $sorted .name -}}{{- end -}}
{{- $sorted = sortAlpha $sorted -}}
{{- range $g := $eg.groups -}}
{{- $i := 0 -}}
{{- range $j, $n := $sorted -}}{{- if eq $n $g.name -}}{{- $i = $j -}}{{- end -}}{{- end -}}
{{- if hasKey $names $g.name -}}
{{- fail (printf "expertGroups.groups: group %q is listed twice" $g.name) -}}
{{- end -}}
{{- $_ := set $names $g.name true -}}
{{- $gpus := 0 -}}
{{- if $gpu -}}
{{- $gpus = (hasKey $g "gpus" | ternary $g.gpus $eg.gpusPerGroup) | int -}}
{{- end -}}
{{- $island := $g.island | default "" -}}
{{- if $island -}}
{{- if not (hasKey $islands $island) -}}
{{- $_ := set $islands $island (dict "name" $island "node" ($g.node | default "") "clique" "" "gpuProduct" "" "declaredGpus" 0 "resources" dict "groups" list "used" 0) -}}
{{- $order = append $order $island -}}
{{- end -}}
{{- $isl := get $islands $island -}}
{{- if and $g.node $isl.node (ne $g.node $isl.node) -}}
{{- fail (printf "expertGroups.groups: group %q names node %q but island %q is on node %q (an NVLink island lives on one node; name islands uniquely across nodes)" $g.name $g.node $island $isl.node) -}}
{{- end -}}
{{- if and $g.node (not $isl.node) -}}
{{- $_ := set $isl "node" $g.node -}}
{{- end -}}
{{- $_ := set $isl "groups" (append $isl.groups $g.name) -}}
{{- $_ := set $isl "used" (add $isl.used $gpus) -}}
{{- else -}}
{{- $pooled = append $pooled $g.name -}}
{{- end -}}
{{- $groups = append $groups (dict "name" $g.name "index" $i "port" (add $eg.portBase $i) "island" $island "gpus" $gpus "experts" $g.experts) -}}
{{- end -}}
{{- if gt (len $groups) (add $.Values.networkPolicy.groupPortSpan 1 | int) -}}
{{- fail (printf "expertGroups.groups: %d groups need ports %d-%d, beyond networkPolicy.groupPortSpan=%d" (len $groups) ($eg.portBase | int) (add $eg.portBase (len $groups) -1) ($.Values.networkPolicy.groupPortSpan | int)) -}}
{{- end -}}
{{- $out := list -}}
{{- range $order -}}
{{- $isl := get $islands . -}}
{{- $cap := $isl.used -}}
{{- if $gpu -}}
{{- if $isl.declaredGpus -}}
{{- if gt (int $isl.used) (int $isl.declaredGpus) -}}
{{- fail (printf "expertGroups: island %q has %d GPUs but its groups %v need %d" $isl.name (int $isl.declaredGpus) $isl.groups (int $isl.used)) -}}
{{- end -}}
{{- $cap = $isl.declaredGpus -}}
{{- end -}}
{{- if lt (int $cap) 1 -}}
{{- fail (printf "expertGroups: island %q has no GPUs (set islands[].gpus or the groups' gpus)" $isl.name) -}}
{{- end -}}
{{- else -}}
{{- $cap = max (len $isl.groups) 1 -}}
{{- end -}}
{{- $_ := set $isl "gpus" (ternary (int $cap) 0 $gpu) -}}
{{- $_ := set $isl "capacity" (int $cap) -}}
{{- $_ := set $isl "resource" (printf "expertmesh.io/island-%s" $isl.name) -}}
{{- $out = append $out $isl -}}
{{- end -}}
{{- toJson (dict "islands" $out "groups" $groups "pooled" $pooled) -}}
{{- end -}}

{{/* Container security context; call with (dict "ctx" $ "readOnly" bool). */}}
{{- define "expertmesh.containerSecurityContext" -}}
{{- $sc := deepCopy .ctx.Values.securityContext -}}
{{- if hasKey . "readOnly" -}}
{{- $_ := set $sc "readOnlyRootFilesystem" .readOnly -}}
{{- end -}}
{{- toYaml $sc -}}
{{- end -}}

{{/* Pod template of a Ray head or worker. Call with (dict "ctx" $ "role" "head"|"worker"
     "island" name? "image" "resources" "nodeSelector" "tolerations" "gpus"). KubeRay adds the
     `ray start` command, its probes and its ports' wiring to the first container. */}}
{{- define "expertmesh.rayPodTemplate" -}}
{{- $ctx := .ctx -}}
{{- $gpu := and (eq $ctx.Values.mode "gpu") (gt (int .gpus) 0) -}}
{{- $w := $ctx.Values.expertGroups.worker -}}
metadata:
  labels:
    {{- include "expertmesh.labels" (dict "ctx" $ctx "component" "expert-group") | nindent 4 }}
    expertmesh.io/ray-role: {{ .role }}
    {{- with .island }}
    expertmesh.io/island: {{ . | quote }}
    {{- end }}
spec:
  serviceAccountName: {{ include "expertmesh.serviceAccountName" $ctx }}
  automountServiceAccountToken: false
  securityContext:
    {{- toYaml $ctx.Values.podSecurityContext | nindent 4 }}
  {{- with $ctx.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ printf "ray-%s" .role }}
      image: {{ .image | quote }}
      imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
      {{- if eq .role "head" }}
      ports:
        - {name: gcs-server, containerPort: 6379, protocol: TCP}
        - {name: dashboard, containerPort: 8265, protocol: TCP}
        - {name: client, containerPort: 10001, protocol: TCP}
        - {name: serve, containerPort: 8000, protocol: TCP}
      {{- end }}
      env:
        {{- include "expertmesh.env" (dict "ctx" $ctx "component" "expert-group") | nindent 8 }}
      resources:
        {{- $res := deepCopy .resources }}
        {{- if $gpu }}
        {{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (int .gpus)) ($res.limits | default dict)) }}
        {{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" (int .gpus)) ($res.requests | default dict)) }}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      securityContext:
        {{- include "expertmesh.containerSecurityContext" (dict "ctx" $ctx "readOnly" $w.readOnlyRootFilesystem) | nindent 8 }}
      volumeMounts:
        {{- include "expertmesh.volumeMounts" $ctx | nindent 8 }}
        - name: shm
          mountPath: /dev/shm
  volumes:
    {{- include "expertmesh.volumes" (dict "ctx" $ctx "component" "expert-group") | nindent 4 }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $w.shmSize | quote }}
  {{- with .nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if and $gpu $w.requireGpuPresentLabel }}
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions:
              - {key: nvidia.com/gpu.present, operator: In, values: ["true"]}
  {{- end }}
  {{- $tol := .tolerations | default list }}
  {{- if $gpu }}
  {{- $tol = prepend $tol (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") }}
  {{- end }}
  {{- with $tol }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* A control loop's environment: <prefix>ENABLED and one <prefix><NAME> per setting (call with
  (dict "prefix" "EXPERTMESH_DRIFT_" "loop" .Values.orchestrator.drift)); the settings' names are the
  config fields the schema lists. */}}
{{- define "expertmesh.loopEnv" -}}
- name: {{ .prefix }}ENABLED
  value: {{ .loop.enabled | quote }}
{{- range $name, $value := .loop.settings }}
- name: {{ $.prefix }}{{ upper $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}
