"""Gateway configuration: a YAML file, overridden by FLEETGATE_* environment variables.

Precedence (highest first): explicit keyword arguments, environment (prefix FLEETGATE_, nesting with
`__`, e.g. FLEETGATE_LIMITS__QUEUE_SIZE=64 or FLEETGATE_API_KEYS='["k1"]'), the YAML file, defaults.
`fleetgate config check FILE` runs the same validation and explains every problem it finds.
"""

from gateway.config.autoscale import (
    ActuatorConfig,
    AutoscaleConfig,
    DeploymentConfig,
    DeploymentGroupConfig,
    DeploymentServiceConfig,
    DockerActuatorConfig,
    ReplanConfig,
    SimActuatorConfig,
    WebhookActuatorConfig,
)
from gateway.config.base import (
    WORKER_ID_RE,
    ConfigError,
    MiB,
    _all_positive,
    _deprecated_key,
    _Strict,
    check_worker_id,
)
from gateway.config.gateway import _FILE_DATA, GatewayConfig, _AliasSource, _FileSource
from gateway.config.load import (
    _DictOf,
    _known_fields,
    _model_type,
    _policy_refs,
    _short,
    alias_problems,
    check_config_cli,
    configured_models,
    deployment_problems,
    describe_validation_error,
    discovery_problems,
    engine_problems,
    format_loc,
    key_problems,
    load_config,
    read_yaml,
    replan_problems,
    semantic_problems,
    summarize,
    unknown_policy_problems,
    unmodelled_workers,
)
from gateway.config.models import (
    AdapterConfig,
    KvEventsConfig,
    LearningConfig,
    ModelConfig,
    PdConfig,
    RebalanceConfig,
    ResumeConfig,
    SloClassName,
    SloConfig,
)
from gateway.config.ops import (
    AdminConfig,
    BatchConfig,
    ListenConfig,
    LoggingConfig,
    MetricsConfig,
    ServerConfig,
    StatusConfig,
    TracingConfig,
)
from gateway.config.pooling import SharedEngineConfig, SharedHostConfig, SharedSleepLevel
from gateway.config.tenancy import (
    ApiKeyConfig,
    AuthConfig,
    LimitsConfig,
    ServicePriorityConfig,
    ServiceSource,
)
from gateway.config.workers import (
    HealthConfig,
    KvEventsSource,
    TimeoutsConfig,
    UpstreamConfig,
    UpstreamTlsConfig,
    WorkerConfig,
    WorkerDiscoveryConfig,
    check_worker_url,
    parse_nameserver,
)

__all__ = ['ActuatorConfig', 'AdapterConfig', 'AdminConfig', 'ApiKeyConfig', 'AuthConfig', 'AutoscaleConfig', 'BatchConfig', 'ConfigError', 'DeploymentConfig', 'DeploymentGroupConfig', 'DeploymentServiceConfig', 'DockerActuatorConfig', 'GatewayConfig', 'HealthConfig', 'KvEventsConfig', 'KvEventsSource', 'LearningConfig', 'LimitsConfig', 'ListenConfig', 'LoggingConfig', 'MetricsConfig', 'MiB', 'ModelConfig', 'PdConfig', 'RebalanceConfig', 'ReplanConfig', 'ResumeConfig', 'ServerConfig', 'ServicePriorityConfig', 'ServiceSource', 'SharedEngineConfig', 'SharedHostConfig', 'SharedSleepLevel', 'SimActuatorConfig', 'SloClassName', 'SloConfig', 'StatusConfig', 'TimeoutsConfig', 'TracingConfig', 'UpstreamConfig', 'UpstreamTlsConfig', 'WORKER_ID_RE', 'WebhookActuatorConfig', 'WorkerConfig', 'WorkerDiscoveryConfig', '_AliasSource', '_DictOf', '_FILE_DATA', '_FileSource', '_Strict', '_all_positive', '_deprecated_key', '_known_fields', '_model_type', '_policy_refs', '_short', 'alias_problems', 'check_config_cli', 'check_worker_id', 'check_worker_url', 'configured_models', 'deployment_problems', 'describe_validation_error', 'discovery_problems', 'engine_problems', 'format_loc', 'key_problems', 'load_config', 'parse_nameserver', 'read_yaml', 'replan_problems', 'semantic_problems', 'summarize', 'unknown_policy_problems', 'unmodelled_workers']
