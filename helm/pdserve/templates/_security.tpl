{{/*
Security: which Secrets hold the credentials, how they are mounted (one read-only
projected volume per pod at pdserve.secretsDir) and which PDSERVE_* settings point at the
files. Roles: router, prefill, decode, and launcher (the KubeRay head: the router
actors, so the router's files).
*/}}
{{- define "pdserve.secretsDir" -}}/etc/pdserve/secrets{{- end -}}

{{- define "pdserve.certRole" -}}
{{- ternary "router" . (eq . "launcher") -}}
{{- end -}}

{{- define "pdserve.internalTLSSecret" -}}
{{- $it := .root.Values.security.internalTLS -}}
{{- if eq $it.source "existingSecret" -}}
{{- $it.existingSecret -}}
{{- else if eq $it.source "certManager" -}}
{{- printf "%s-%s-tls" (include "pdserve.fullname" .root) (include "pdserve.certRole" .role) -}}
{{- else -}}
{{- printf "%s-internal-tls" (include "pdserve.fullname" .root) -}}
{{- end -}}
{{- end -}}

{{/* The internal Secret's keys for (ca, cert, key) of a role, space-separated. */}}
{{- define "pdserve.internalTLSKeys" -}}
{{- $role := include "pdserve.certRole" .role -}}
{{- if eq .root.Values.security.internalTLS.source "certManager" -}}
ca.crt tls.crt tls.key
{{- else -}}
{{- printf "ca.crt %s.crt %s.key" $role $role -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.publicTLSSecret" -}}
{{- $pt := .Values.security.publicTLS -}}
{{- if $pt.certManager.enabled -}}
{{- printf "%s-public-tls" (include "pdserve.fullname" .) -}}
{{- else -}}
{{- $pt.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.apiKeysSecret" -}}
{{- .Values.security.apiKeys.existingSecret | default (printf "%s-api-keys" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{- define "pdserve.clusterSecret" -}}
{{- .Values.security.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* Whether a role serves the public API (router, or the KubeRay head's routers). */}}
{{- define "pdserve.servesPublic" -}}
{{- if has . (list "router" "launcher") }}true{{ end -}}
{{- end -}}

{{/* The projected volume of a role's Secrets: (dict "root" $ "role" "decode"). */}}
{{- define "pdserve.secretsVolume" -}}
{{- $s := .root.Values.security -}}
{{- $public := include "pdserve.servesPublic" .role -}}
- name: pdserve-secrets
  projected:
    # Owner root, group fsGroup: readable by the pdserve user, by nobody else.
    defaultMode: 288 # 0440
    sources:
      {{- if $s.internalTLS.enabled }}
      {{- $keys := splitList " " (include "pdserve.internalTLSKeys" .) }}
      - secret:
          name: {{ include "pdserve.internalTLSSecret" . }}
          items:
            - key: {{ index $keys 0 }}
              path: internal/ca.crt
            - key: {{ index $keys 1 }}
              path: internal/tls.crt
            - key: {{ index $keys 2 }}
              path: internal/tls.key
      {{- end }}
      {{- if and $public $s.publicTLS.enabled }}
      - secret:
          name: {{ include "pdserve.publicTLSSecret" .root }}
          items:
            - key: tls.crt
              path: public/tls.crt
            - key: tls.key
              path: public/tls.key
      {{- if $s.publicTLS.requireClientCert }}
      - secret:
          name: {{ $s.publicTLS.clientCASecret | default (include "pdserve.publicTLSSecret" .root) }}
          items:
            - key: ca.crt
              path: public/client-ca.crt
      {{- end }}
      {{- end }}
      {{- if and $public $s.apiKeys.enabled }}
      - secret:
          name: {{ include "pdserve.apiKeysSecret" .root }}
          items:
            - key: {{ $s.apiKeys.fileKey }}
              path: api-keys
      {{- end }}
      - secret:
          name: {{ include "pdserve.clusterSecret" .root }}
          items:
            - key: {{ $s.clusterSecret.key }}
              path: cluster-secret
{{- end -}}

{{- define "pdserve.secretsMount" -}}
- name: pdserve-secrets
  mountPath: {{ include "pdserve.secretsDir" . }}
  readOnly: true
{{- end -}}

{{/* ConfigMap lines (indented by 2): the settings that point at a role's files. */}}
{{- define "pdserve.securityData" -}}
{{- $s := .root.Values.security -}}
{{- $dir := include "pdserve.secretsDir" . -}}
{{- $public := include "pdserve.servesPublic" .role -}}
{{- if $s.internalTLS.enabled }}
  PDSERVE_INTERNAL_TLS_CA_FILE: {{ printf "%s/internal/ca.crt" $dir | quote }}
  PDSERVE_INTERNAL_TLS_CERT_FILE: {{ printf "%s/internal/tls.crt" $dir | quote }}
  PDSERVE_INTERNAL_TLS_KEY_FILE: {{ printf "%s/internal/tls.key" $dir | quote }}
{{- end }}
{{- if and $public $s.publicTLS.enabled }}
  PDSERVE_TLS_CERT_FILE: {{ printf "%s/public/tls.crt" $dir | quote }}
  PDSERVE_TLS_KEY_FILE: {{ printf "%s/public/tls.key" $dir | quote }}
  {{- if $s.publicTLS.requireClientCert }}
  PDSERVE_TLS_CLIENT_CA_FILE: {{ printf "%s/public/client-ca.crt" $dir | quote }}
  {{- end }}
{{- end }}
{{- if and $public $s.apiKeys.enabled }}
  PDSERVE_API_KEYS_FILE: {{ printf "%s/api-keys" $dir | quote }}
{{- end }}
  PDSERVE_CLUSTER_SECRET_FILE: {{ printf "%s/cluster-secret" $dir | quote }}
{{- if $s.allowInsecure }}
  PDSERVE_ALLOW_INSECURE: "true"
{{- end }}
{{- end -}}

{{/* A checksum of a role's credentials, so that a rotated Secret restarts its pods. */}}
{{- define "pdserve.secretsChecksum" -}}
{{- $names := list (include "pdserve.clusterSecret" .root) -}}
{{- if .root.Values.security.internalTLS.enabled -}}
{{- $names = append $names (include "pdserve.internalTLSSecret" .) -}}
{{- end -}}
{{- $data := list -}}
{{- range $name := $names -}}
{{- $found := lookup "v1" "Secret" $.root.Release.Namespace $name -}}
{{- $data = append $data (toJson (get ($found | default dict) "data")) -}}
{{- end -}}
{{- join "," $data | sha256sum -}}
{{- end -}}

{{/* The refusals of insecure or incomplete security values. */}}
{{- define "pdserve.validateSecurity" -}}
{{- $s := .Values.security -}}
{{- if not $s.allowInsecure -}}
{{- if not (or $s.apiKeys.enabled $s.publicTLS.enabled) -}}
{{- fail "security: with neither apiKeys nor publicTLS enabled the router's API is open to anyone who reaches it; enable one, or set security.allowInsecure=true" -}}
{{- end -}}
{{- if not $s.internalTLS.enabled -}}
{{- fail "security.internalTLS.enabled=false leaves the worker APIs and KV transfers unauthenticated and in plaintext; set security.allowInsecure=true to accept this" -}}
{{- end -}}
{{- if and .Values.redis.enabled (not .Values.redis.auth.enabled) -}}
{{- fail "redis.auth.enabled=false runs Redis without a password; set security.allowInsecure=true to accept this" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) (not .Values.externalRedis.existingSecret) -}}
{{- fail "externalRedis.existingSecret is empty: name the Secret with the Redis password, or set security.allowInsecure=true for a Redis without one" -}}
{{- end -}}
{{- end -}}
{{- if $s.publicTLS.enabled -}}
{{- if eq (not $s.publicTLS.certManager.enabled) (not $s.publicTLS.existingSecret) -}}
{{- fail "security.publicTLS: set exactly one of existingSecret and certManager.enabled" -}}
{{- end -}}
{{- if $s.publicTLS.certManager.enabled -}}
{{- if not $s.publicTLS.certManager.issuerRef.name -}}
{{- fail "security.publicTLS.certManager.issuerRef.name is required (the Issuer of the public certificate)" -}}
{{- end -}}
{{- if not $s.publicTLS.certManager.dnsNames -}}
{{- fail "security.publicTLS.certManager.dnsNames is required (the names clients connect to)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $s.internalTLS.enabled (eq $s.internalTLS.source "existingSecret") (not $s.internalTLS.existingSecret) -}}
{{- fail "security.internalTLS.existingSecret is required when source is existingSecret" -}}
{{- end -}}
{{- if and $s.apiKeys.enabled (not $s.apiKeys.existingSecret) (not $s.apiKeys.clients) -}}
{{- fail "security.apiKeys: name at least one client in clients, or give existingSecret" -}}
{{- end -}}
{{- range $key := list "dashboard-host" "include-dashboard" -}}
{{- if hasKey $.Values.kuberay.head.rayStartParams $key -}}
{{- fail (printf "kuberay.head.rayStartParams.%s: set kuberay.dashboard instead" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
